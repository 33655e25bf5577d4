"""Credentials are never staged, whatever their names: the files a provider's credential variables name
(GOOGLE_APPLICATION_CREDENTIALS with the console's default download name, AWS_SHARED_CREDENTIALS_FILE, a
CLOUDSDK_CONFIG folder) and every small file whose content is a private key (service-account JSON, PEM, OpenSSH,
an AWS credentials file); the staging line names each with why.  Real files, the real plan, tar and local copy."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

SA = json.dumps({"type": "service_account", "project_id": "my-proj-123456", "private_key_id": "0a1b2c3d4e5f",
                 "private_key": "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkq\n-----END PRIVATE KEY-----\n",
                 "client_email": "x@my-proj-123456.iam.gserviceaccount.com"}, indent=2)
PEM_RSA = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----\n"
OPENSSH = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
AWS = "[default]\naws_access_key_id = AKIAEXAMPLE\naws_secret_access_key = abc/def\n"


def _work(tmp_path: Path) -> Path:
    w = tmp_path / "w"
    (w / "conf").mkdir(parents=True)
    (w / "gcloud").mkdir()
    (w / "train.py").write_text("print('DDP_OK')\n")
    (w / "my-proj-123456-0a1b2c3d4e5f.json").write_text(SA)
    for name in ("key.json", "sa.json", "gcp-key.json"):
        (w / name).write_text(SA)
    (w / "aws_credentials.ini").write_text(AWS)
    (w / "conf" / "tls.bak").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n" + PEM_RSA)
    (w / "deploy").write_text(OPENSSH)
    (w / "profile.cfg").write_text("[default]\nregion = us-east-1\n")  # named by AWS_SHARED_CREDENTIALS_FILE
    (w / "gcloud" / "access_tokens.db").write_text("tok")  # inside the CLOUDSDK_CONFIG folder
    # look alike but are not keys: staged
    (w / "conf" / "model.json").write_text(json.dumps({"private_key_size": 3, "layers": 2}))
    (w / "notes.txt").write_text("how to make a key: openssl genrsa; the PRIVATE KEY header starts with -----\n")
    (w / "keys.py").write_text('PEM = """\n-----BEGIN PRIVATE KEY-----\n"""\n')  # source code: not sniffed
    return w


LEFT_OUT = {"my-proj-123456-0a1b2c3d4e5f.json": "named by GOOGLE_APPLICATION_CREDENTIALS",
            "key.json": "a private key: service-account JSON", "sa.json": "service-account JSON",
            "gcp-key.json": "service-account JSON", "aws_credentials.ini": "AWS credentials file", "conf/tls.bak": "RSA PRIVATE KEY",
            "deploy": "OPENSSH PRIVATE KEY", "profile.cfg": "named by AWS_SHARED_CREDENTIALS_FILE",
            "gcloud/": "named by CLOUDSDK_CONFIG"}


def test_credentials_are_left_out_by_variable_and_by_content_and_named(tmp_path, monkeypatch):
    from broker.run.staging import copy_staged, recipe_stage_plan, staged_tar

    w = _work(tmp_path)
    monkeypatch.chdir(w)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(w / "my-proj-123456-0a1b2c3d4e5f.json"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "profile.cfg")  # relative: from the current folder
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(w / "gcloud"))
    # the recipe names a key in its arguments: still not staged
    plan = recipe_stage_plan(w, "train.py", ["--key", "key.json", "--conf", "conf/model.json"])
    staged = sorted(p.as_posix() for p in plan.files)
    assert staged == ["conf/model.json", "keys.py", "notes.txt", "train.py"], staged
    assert set(plan.credentials) == set(LEFT_OUT)
    for name, why in LEFT_OUT.items():
        assert why in plan.credentials[name], (name, plan.credentials[name])
    line = plan.summary()
    assert "credentials not staged: " in line
    for name, why in sorted(plan.credentials.items()):
        assert f"{name} ({why})" in line, (name, line)
    with staged_tar(plan, tmp_path / "run") as t, tarfile.open(t.path, "r:*") as tar:  # what an SSH node gets
        assert sorted(m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()) == staged
    copy_staged(plan, tmp_path / "node0")  # what a local node gets
    assert sorted(p.relative_to(tmp_path / "node0").as_posix() for p in (tmp_path / "node0").rglob("*")
                  if p.is_file()) == staged


def test_a_local_run_says_which_credentials_it_left_out(tmp_path, monkeypatch):
    from broker.core.recipe import load_recipe
    from broker.money.ledger import Ledger
    from broker.run.pipeline import Hooks, LocalTarget, run_pipeline

    w = _work(tmp_path)
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(w / "my-proj-123456-0a1b2c3d4e5f.json"))
    (w / "r.yaml").write_text("name: t\nscript: train.py\nnodes: 1\ncpu_ok: true\nbudget_usd: 1\nmax_hours: 1\n"
                              "expect: [DDP_OK]\n")
    recipe = load_recipe(w / "r.yaml")
    said: list[str] = []
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=Ledger(), hooks=Hooks(say=said.append))
    assert out.exit_code == 0, out.result.reason
    line = next(s for s in said if s.startswith("staged "))
    assert "my-proj-123456-0a1b2c3d4e5f.json (named by GOOGLE_APPLICATION_CREDENTIALS)" in line, line
    assert "key.json (a private key: service-account JSON)" in line
    home = tmp_path / "home"
    assert not [p for p in home.rglob("*") if p.name in {"key.json", "sa.json", "my-proj-123456-0a1b2c3d4e5f.json",
                                                          "aws_credentials.ini", "deploy", "tls.bak"}]
    listing = (Path(out.run.run_dir) / "staged.txt").read_text()
    assert "named by GOOGLE_APPLICATION_CREDENTIALS: my-proj-123456-0a1b2c3d4e5f.json" in listing
