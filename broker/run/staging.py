"""What of a recipe's ``workdir`` is copied to the nodes: one staging rule for every executor.

:func:`stage_plan` walks the work folder once and returns the files to copy; local runs copy them into each node's
folder, SSH runs pack them into one tar.gz, Slurm runs copy them to the job folder.  What is never copied:

* always: ``.git``, virtual environments (``.venv``, ``venv``, any folder holding a ``pyvenv.cfg``),
  ``node_modules``, ``__pycache__``/``*.pyc``, ``.env*`` files (``.env``, ``.envrc``, ``.env.local``, ...), SSH and
  cloud keys (``id_*`` key files, ``*.pem``, ``*.key``, ``*.p12``, ``*.pfx``, ``.ssh``, ``.oci``, ``.aws``,
  ``.vast_api_key``), credential and token files (``credentials*.json``, ``token*.json``, ``.netrc``,
  ``.git-credentials``, ``credentials``, ``client_secret*.json``, ``service-account*.json``, ``.pypirc``, ``.npmrc``,
  ``kubeconfig``, ``.docker/``, ``.kube/``, ``.vault-token``, ``secrets.yaml``) and WireGuard configs (``wg*.conf``,
  ``*.wg.conf``), in any case (``ID_RSA``, ``KEY.PEM``);
* credentials whatever their name: the files (and folders) that a provider's credential variables name
  (``GOOGLE_APPLICATION_CREDENTIALS``, ``AWS_SHARED_CREDENTIALS_FILE``, ...: each adapter declares its own,
  :data:`broker.providers.CREDENTIAL_FILE_VARS`), and every file up to :data:`SNIFF_MAX_BYTES` whose first bytes
  hold a private key (PEM / OpenSSH / PuTTY, a service-account JSON's ``"private_key"``, an AWS credentials file's
  ``aws_secret_access_key``: :func:`private_key_content`), even when the recipe names it; the staging line names
  each one with why (:attr:`StagePlan.credentials`);
* what git ignores (git's wildmatch rules, through the `pathspec <https://pypi.org/project/pathspec/>`_ library): the
  work folder's ``.gitignore`` files (nested ones too) and its ``.brokerignore`` files; when the work folder is inside
  a git work tree, also the ``.gitignore`` files from the repository's root down to the work folder and
  ``.git/info/exclude``, each matched against the path relative to its own folder, the deepest decisive pattern
  winning (as git does);
* symbolic links: one whose target resolves outside the work folder (named in the summary as ``symlink outside the
  workdir``), a dangling one, one to something the rules above exclude (a link to ``.env`` is as secret as
  ``.env``), and a folder link that would loop.  A link inside the work folder to an allowed file is staged as a
  copy of that file's content, by every executor (never as a link); a link to an allowed folder is staged as a copy
  of that folder's staged files.

The staged size per node is reported (:attr:`StagePlan.total_bytes`); above :data:`WARN_BYTES` the caller warns.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

#: staged size per node above which a run warns (bytes): 100 MB
WARN_BYTES = 100 * 1000 * 1000

#: names (files or folders, at any depth) never copied to a node
ALWAYS_SKIP_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "node_modules", "__pycache__", ".mypy_cache",
                    ".pytest_cache", ".ssh", ".oci", ".aws", ".tox", ".docker", ".kube", ".gnupg", ".azure"}
#: gitignore-style patterns never copied to a node (secrets and keys), matched against file names; ``.env*`` covers
#: ``.env``, ``.envrc``, ``.env.local``, ``.env.production``; ``id_*`` the SSH key files (``id_rsa``,
#: ``id_ed25519.pub``, ``id_ecdsa_sk``) but not Python modules (``id_utils.py``); OAuth client / token files
#: (``credentials.json``, ``token.json``, ``token_drive.json``) and WireGuard configs (``wg0.conf``,
#: ``home.wg.conf``: they hold a private key); cloud and registry credentials (AWS ``credentials``, Google's
#: ``application_default_credentials.json``, ``client_secret*.json``, ``service-account*.json``, ``.pypirc``,
#: ``.npmrc``, ``kubeconfig``, ``.vault-token``, ``secrets.yaml``).  Matched case-insensitively (the patterns are
#: lower case and the name is lowered: ``ID_RSA``, ``KEY.PEM``, ``Credentials.json`` are skipped too; see
#: :func:`always_skipped_dir`); ``.docker/`` and ``.kube/`` (their ``config`` holds registry/cluster tokens) are
#: folders of :data:`ALWAYS_SKIP_DIRS`
ALWAYS_SKIP_PATTERNS = [".env*", "*.pyc", "id_*", "!id_*.py", "*.pem", "*.key", "*.p12", "*.pfx", ".vast_api_key",
                        "vast_api_key", ".netrc", "_netrc", "*.ppk", "credentials*.json", "token*.json", "*.wg.conf",
                        "wg*.conf", ".git-credentials", ".pgpass", "credentials", "*_credentials.json",
                        "client_secret*.json", "service-account*.json", "service_account*.json", ".pypirc", ".npmrc",
                        "kubeconfig", "*.kubeconfig", ".vault-token", "secrets.yaml", "secrets.yml", ".dockercfg",
                        "*.jks", "*.keystore"]


def always_skipped_dir(name: str) -> bool:
    """Whether a folder called ``name`` is never copied (:data:`ALWAYS_SKIP_DIRS`, any case: ``.SSH`` too)."""
    return name in ALWAYS_SKIP_DIRS or name.lower() in ALWAYS_SKIP_DIRS

#: the skip reasons named in :meth:`StagePlan.summary`
OUTSIDE = "symlink outside the workdir"
#: the rule that leaves the recipe's ``checkpoint_dir`` out of the staged files (:func:`recipe_stage_plan`)
CHECKPOINT_RULE = "checkpoint_dir"
TO_EXCLUDED = "symlink to an excluded path"
DANGLING = "dangling symlink"
LOOP = "symlink loop"

# which files hold a credential whatever their name (content sniffing, the providers' credential variables)
from broker.run.stagesecrets import (NO_SNIFF_SUFFIXES, SNIFF_HEAD, SNIFF_MAX_BYTES,  # noqa: E402,F401
                                     credential_file_paths, private_key_content)


@dataclass
class StagePlan:
    """The files of ``root`` to copy (paths relative to ``root``), their total size in bytes, and what was skipped
    by which rule (first few names per rule, for the log).  ``sources`` maps a staged path reached through a
    symbolic link to the real file whose content is copied (absolute, inside ``root``)."""

    root: Path
    files: list[Path] = field(default_factory=list)
    total_bytes: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)
    sources: dict[Path, Path] = field(default_factory=dict)
    #: every entry not copied, as its ``/``-separated path relative to ``root`` (the same path a staged file would
    #: have; a folder ends in ``/`` and its content is not listed) -> the rule that skipped it
    excluded: dict[str, str] = field(default_factory=dict)
    #: files the recipe names (its script, files its arguments name) staged although an ignore rule drops them
    #: -> that rule (``scratch/ in /repo/.gitignore``)
    forced: dict[str, str] = field(default_factory=dict)
    #: how many files the recipe's ``checkpoint_dir`` holds that were left out (:func:`recipe_stage_plan`)
    checkpoint_files: int = 0
    #: files (or folders, ending in ``/``) left out as credentials, whatever their name -> why: named by a
    #: provider's credential variable, or their content is a private key
    credentials: dict[str, str] = field(default_factory=dict)
    #: the recipe's ``checkpoint_dir`` when ``resume_checkpoint`` staged it, and how many of its files are staged
    resumed_dir: str | None = None
    resumed_files: int = 0

    def source(self, rel: Path) -> Path:
        """The file whose content is staged at ``rel``."""
        return self.sources.get(rel, self.root / rel)

    def size_text(self) -> str:
        """``1.2 MB`` style size of what is staged."""
        b = float(self.total_bytes)
        for unit in ("B", "kB", "MB", "GB"):
            if b < 1000 or unit == "GB":
                return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
            b /= 1000
        return f"{b:.1f} GB"  # pragma: no cover

    def summary(self) -> str:
        """One line: ``staged 12 files, 1.2 MB per node (not copied: .git, .env; skipped: shadowlink (symlink
        outside the workdir))``."""
        links = (OUTSIDE, TO_EXCLUDED, DANGLING, LOOP)
        skipped = sorted(n for n, rule in self.excluded.items()
                         if rule not in (*links, CHECKPOINT_RULE) and n not in self.credentials)
        more = f" (not copied: {', '.join(skipped[:6])}{', ...' if len(skipped) > 6 else ''})" if skipped else ""
        named = [f"{n} ({rule})" for rule in links for n in sorted(self.excluded) if self.excluded[n] == rule]
        if named:
            more += f" (skipped: {', '.join(named[:6])}{', ...' if len(named) > 6 else ''})"
        if self.credentials:
            creds = [f"{n} ({why})" for n, why in sorted(self.credentials.items())]
            more += (" (credentials not staged: " + ", ".join(creds[:20])
                     + (f", and {len(creds) - 20} more (see staged.txt)" if len(creds) > 20 else "") + ")")
        ck = sorted(n for n, rule in self.excluded.items() if rule == CHECKPOINT_RULE)
        if ck:
            n = self.checkpoint_files
            more += (f" (checkpoint_dir {', '.join(ck)} not staged, {n} file{'' if n == 1 else 's'} left out: a new "
                     "run starts without the checkpoint left in the work folder; resume_checkpoint: true in the "
                     "recipe starts from it)")
        if self.resumed_dir is not None:
            n = self.resumed_files
            more += (f" (checkpoint_dir {self.resumed_dir}/ staged, {n} file{'' if n == 1 else 's'}: "
                     "resume_checkpoint: true, the job starts from it)" if n else
                     f" (checkpoint_dir {self.resumed_dir}/ is empty or missing: resume_checkpoint: true, but the "
                     "job starts from scratch)")
        if self.forced:
            more += " (staged although ignored, the recipe names them: " + ", ".join(
                f"{n} ({rule})" for n, rule in sorted(self.forced.items())[:6]) + ")"
        return f"staged {len(self.files):,} file(s), {self.size_text()} per node from {self.root}{more}"

    @property
    def too_big(self) -> bool:
        return self.total_bytes > WARN_BYTES


def _spec(lines: list[str]):
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(lines)


def _read_ignore(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def _is_venv(d: Path) -> bool:
    return (d / "pyvenv.cfg").is_file()


def _decide(spec, path: str) -> bool | None:
    """The last pattern of ``spec`` matching ``path`` decides: True (ignored), False (negated: kept), None (none
    matches)."""
    out = None
    for pat in spec.patterns:
        if pat.include is not None and pat.match_file(path) is not None:
            out = bool(pat.include)
    return out


def git_top(folder: Path) -> Path | None:
    """The root of the git work tree holding ``folder`` (the nearest folder upwards with a ``.git``), or None."""
    for d in (folder, *folder.parents):
        if (d / ".git").exists():
            return d
    return None


def _git_exclude(top: Path) -> list[str]:
    """``.git/info/exclude`` of the work tree ``top`` (a worktree's ``.git`` file leads to its common folder)."""
    g = top / ".git"
    if g.is_file():
        text = _read_ignore(g)
        line = text[0] if text else ""
        if not line.startswith("gitdir:"):
            return []
        g = (top / line.split(":", 1)[1].strip()).resolve()
        common = _read_ignore(g / "commondir")
        if common:
            g = (g / common[0].strip()).resolve()
    return _read_ignore(g / "info" / "exclude")


class _Rules:
    """The ignore rules for paths inside ``root`` (a resolved folder): see the module docstring."""

    def __init__(self, root: Path):
        self.root = root
        top = git_top(root)
        self.top = top if top is not None else root
        self.prefix = [] if top is None else list(root.relative_to(top).parts)
        self.exclude = _spec(_git_exclude(top)) if top is not None else None
        self.always = _spec(ALWAYS_SKIP_PATTERNS)
        self._specs: dict[tuple[str, ...], object] = {}

    def _dir_spec(self, parts: tuple[str, ...]):
        """The spec of the folder ``parts`` (relative to the repository root); None when it has no rules."""
        if parts not in self._specs:
            d = self.top.joinpath(*parts)
            lines = _read_ignore(d / ".gitignore")
            if len(parts) >= len(self.prefix):  # the work folder and below: .brokerignore too
                lines += _read_ignore(d / ".brokerignore")
            self._specs[parts] = _spec(lines) if lines else None
        return self._specs[parts]

    def _git_ignored(self, parts: list[str], is_dir: bool) -> bool:
        full = self.prefix + parts
        for j in range(len(full) - 1, -1, -1):
            spec = self._dir_spec(tuple(full[:j]))
            if spec is None:
                continue
            verdict = _decide(spec, "/".join(full[j:]) + ("/" if is_dir else ""))
            if verdict is not None:
                return verdict
        if self.exclude is not None:
            return bool(_decide(self.exclude, "/".join(full) + ("/" if is_dir else "")))
        return False

    def ignoring_rule(self, rel: str) -> str | None:
        """The ignore rule that drops the path ``rel`` (a file relative to the work folder) or a folder above it,
        as ``pattern in file`` (``scratch/ in /repo/.gitignore``); None when none does."""
        parts = rel.split("/")
        for k in range(1, len(parts) + 1):
            sub, is_dir = parts[:k], k < len(parts)
            full = self.prefix + sub
            for j in range(len(full) - 1, -1, -1):
                spec = self._dir_spec(tuple(full[:j]))
                if spec is None:
                    continue
                path = "/".join(full[j:]) + ("/" if is_dir else "")
                hit = None
                for pat in spec.patterns:
                    if pat.include is not None and pat.match_file(path) is not None:
                        hit = pat if pat.include else None
                if hit is not None:
                    d = self.top.joinpath(*full[:j])
                    where = d / ".gitignore" if hit.pattern in _read_ignore(d / ".gitignore") else d / ".brokerignore"
                    return f"{hit.pattern} in {where}"
                if any(pat.include is not None and pat.match_file(path) is not None for pat in spec.patterns):
                    break  # a negation decided: kept at this level
            if self.exclude is not None and _decide(self.exclude, "/".join(full) + ("/" if is_dir else "")):
                return f"a pattern in {self.top / '.git' / 'info' / 'exclude'}"
        return None

    def why(self, rel: str, is_dir: bool, *, ancestors: bool = False) -> str | None:
        """Why the path ``rel`` (relative to the work folder) is not staged: ``"always"``, ``"ignore file"`` or None.
        ``ancestors``: also check every folder above it (a path not reached by walking from the root)."""
        parts = rel.split("/") if rel else []
        checks = [(parts[:k], True) for k in range(1, len(parts))] if ancestors else []
        for sub, sub_dir in checks + [(parts, is_dir)]:
            name = sub[-1]
            if sub_dir and (always_skipped_dir(name) or _is_venv(self.root.joinpath(*sub))):
                return "always"
            if not sub_dir and self.always.match_file(name.lower()):
                return "always"
            if self._git_ignored(sub, sub_dir):
                return "ignore file"
        return None


def recipe_files(workdir: Path, script: Path | str, args: list[str] = ()) -> list[str]:
    """The files a recipe names inside ``workdir``: its script, and each argument that is the path of a file
    there (``--config conf/base.yaml``, ``--data=data/train.txt``), as ``/``-separated paths relative to
    ``workdir`` (what :func:`stage_plan` takes as ``keep``)."""
    from broker.core.recipe import path_words

    root = Path(workdir).resolve()
    out: list[str] = []
    for word in path_words(script, args):
        p = Path(word) if Path(word).is_absolute() else root / word
        try:
            real = p.resolve()
            if real.is_file() and root in real.parents:
                rel = real.relative_to(root).as_posix()
                if rel not in out:
                    out.append(rel)
        except OSError:
            continue
    return out


#: the rule that skips broker's own home when it lies inside a work folder
BROKER_HOME_RULE = "broker home"


def _broker_home() -> Path | None:
    """The broker home (resolved), or None when it cannot be known."""
    try:
        from broker.core.config import home_path

        return home_path().resolve()
    except Exception:  # noqa: BLE001 - staging never fails for this
        return None


def stage_plan(root: Path, keep: list[str] = (), leave_out: dict[str, str] | None = None) -> StagePlan:
    """Walk ``root`` and decide what to copy (see the module docstring for the rules, symbolic links included).
    ``keep``: files the recipe names (:func:`recipe_files`): staged even when an ignore file drops them (the
    rule is recorded in :attr:`StagePlan.forced`), never when an always-skipped rule does (secrets, keys).
    ``leave_out``: ``/``-separated folder paths relative to ``root`` -> the rule that leaves them (and what lies
    below them, also reached through a link) out, whatever ``keep`` says.
    Raises FileNotFoundError when ``root`` is not a folder."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"work folder {root} does not exist")
    w = _Walk(root, leave_out)
    w.walk(w.real_root, "", frozenset({w.real_root}), False)
    for rel in keep:
        w.keep_named(rel)
    return w.plan


class _Walk:
    """One walk of a work folder for :func:`stage_plan`: the rules, the credentials to leave home, the folders
    left out, and the :class:`StagePlan` being filled."""

    def __init__(self, root: Path, leave_out: dict[str, str] | None):
        self.real_root = root.resolve()
        self.rules = _Rules(self.real_root)
        self.plan = StagePlan(root=root)
        self.home = _broker_home()
        self.creds = credential_file_paths()
        self.left = {k.strip("/"): v for k, v in (leave_out or {}).items() if k.strip("/")}

    def left_out(self, rel: str) -> str | None:
        """The rule of the left-out folder that holds ``rel`` (itself included), or None."""
        return next((rule for k, rule in self.left.items() if rel == k or rel.startswith(k + "/")), None)

    def note(self, rule: str, name: str) -> None:
        """``name`` is not staged, because of ``rule`` (the summary keeps the first 20 names per rule)."""
        self.plan.excluded[name] = rule
        lst = self.plan.skipped.setdefault(rule, [])
        if len(lst) < 20:
            lst.append(name)

    def credential(self, rel: str, why: str) -> None:
        self.plan.credentials[rel] = why
        self.note(why, rel)

    def add(self, rel: str, real: Path, linked: bool) -> bool:
        """Stage ``rel`` (content from ``real``, a real path) unless it is a credential; whether it was."""
        try:
            size = real.stat().st_size
        except OSError:
            self.note("unreadable", rel)
            return False
        # ``real`` is a real path (the walk goes through resolved folders, a link's target is resolved): no lookup
        if self.creds and (var := self.creds.get(str(real)) or _under(str(real), self.creds)):
            self.credential(rel, f"named by {var}")
            return False
        if (size <= SNIFF_MAX_BYTES and os.path.splitext(rel)[1].lower() not in NO_SNIFF_SUFFIXES
                and (why := private_key_content(real))):
            self.credential(rel, why)
            return False
        self.plan.files.append(Path(rel))
        self.plan.total_bytes += size
        if linked:
            self.plan.sources[Path(rel)] = real
        return True

    def walk(self, real_dir: Path, rel_dir: str, chain: frozenset[Path], linked: bool) -> None:
        """``real_dir``: the folder's real path; ``rel_dir``: where it is staged; ``chain``: the real folders above
        (loop guard); ``linked``: reached through a folder link (then the real path is checked too)."""
        try:
            entries = sorted(os.scandir(real_dir), key=lambda e: e.name)
        except OSError:
            self.note("unreadable", rel_dir + "/")
            return
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            real = real_dir / e.name
            if self.left and (rule := self._left_out_entry(e, rel, real, linked)):
                self.note(rule, rel + "/" if e.is_dir() else rel)
            elif e.is_symlink():
                self._link(rel, real, chain, linked)
            else:
                self._entry(e, rel, real, chain, linked)

    def _left_out_entry(self, e: os.DirEntry, rel: str, real: Path, linked: bool) -> str | None:
        """The left-out rule that drops this entry: the folder as staged, where it really is, and where a link to
        it points."""
        rule = self.left_out(rel) or (self.left_out(real.relative_to(self.real_root).as_posix()) if linked else None)
        if rule is None and e.is_symlink():
            tgt = Path(os.path.realpath(real))
            rule = self.left_out(tgt.relative_to(self.real_root).as_posix()) \
                if tgt.is_relative_to(self.real_root) else None
        return rule

    def _link(self, rel: str, real: Path, chain: frozenset[Path], linked: bool) -> None:
        """A symbolic link: staged as a copy of its target (a file's content, a folder's staged files) when that
        lies inside the work folder and the rules allow both names; else noted with why."""
        try:
            os.stat(real)
        except OSError as err:
            if err.errno == errno.ELOOP:  # links that point at each other: realpath() gives up quietly
                self.note(LOOP, rel)
                return
        target = Path(os.path.realpath(real))
        if target != self.real_root and self.real_root not in target.parents:
            self.note(OUTSIDE, rel)
            return
        if not target.exists():
            self.note(DANGLING, rel)
            return
        is_dir = target.is_dir()
        trel = target.relative_to(self.real_root).as_posix() if target != self.real_root else ""
        if self.rules.why(rel, is_dir, ancestors=linked) or (trel and self.rules.why(trel, is_dir, ancestors=True)):
            self.note(TO_EXCLUDED, rel)
        elif is_dir:
            if target in chain:
                self.note(LOOP, rel)
            else:
                self.walk(target, rel, chain | {target}, True)
        elif target.is_file():
            self.add(rel, target, True)
        else:
            self.note("not a file", rel)

    def _entry(self, e: os.DirEntry, rel: str, real: Path, chain: frozenset[Path], linked: bool) -> None:
        """A file or folder (not a link): staged (a folder walked) unless a rule, broker's home or a credential
        variable drops it."""
        try:
            is_dir = e.is_dir(follow_symlinks=False)
        except OSError:
            self.note("unreadable", rel)
            return
        why = self.rules.why(rel, is_dir, ancestors=linked)
        if not why and is_dir and self.home is not None and real == self.home:
            # broker's own home (ledger, run folders) inside the work folder: never a node's business, and
            # opening the live ledger's files here would drop this process's SQLite locks (POSIX fcntl locks
            # go with any close of the file), letting another process checkpoint the WAL under it
            why = BROKER_HOME_RULE
        if not why and linked:  # reached through a folder link: its real place must be allowed too
            why = self.rules.why(real.relative_to(self.real_root).as_posix(), is_dir, ancestors=True)
        if why:
            self.note(why, rel + "/" if is_dir else rel)  # the path as staged (sub/.aws/, never a bare .aws/)
        elif is_dir and self.creds and (var := self.creds.get(str(real))):
            self.credential(rel + "/", f"named by {var}")
        elif is_dir:
            self.walk(real, rel, chain | {real}, linked)
        elif e.is_file(follow_symlinks=False):
            self.add(rel, real, linked)
        else:
            self.note("not a file", rel)

    def keep_named(self, rel: str) -> None:
        """Stage ``rel``, a file the recipe names, that only an ignore file dropped (the rule goes to
        :attr:`StagePlan.forced`); never a secret, a key, a left-out folder's file or a link."""
        root, plan = self.real_root, self.plan
        if rel in {f.as_posix() for f in plan.files} or not (root / rel).is_file() or (root / rel).is_symlink():
            return
        parts = rel.split("/")
        if any(always_skipped_dir(p) for p in parts[:-1]) or self.rules.always.match_file(parts[-1].lower()):
            return  # a secret or a key stays home even when named
        if self.left and (self.left_out(rel) or self.left_out(os.path.relpath(os.path.realpath(root / rel), root))):
            return
        rule = self.rules.ignoring_rule(rel)
        if rule is None or not self.add(rel, Path(os.path.realpath(root / rel)), False):
            return
        plan.excluded.pop(rel, None)
        plan.forced[rel] = rule


def _under(path: str, roots: dict[str, str]) -> str | None:
    """The variable of the folder among ``roots`` that holds ``path`` (both real paths), or None."""
    for root, var in roots.items():
        if path.startswith(root.rstrip("/") + "/"):
            return var
    return None


def recipe_stage_plan(workdir: Path, script: Path | str, args: list[str] = (), *, checkpoint_dir: str | None = None,
                      resume_checkpoint: bool = False) -> StagePlan:
    """What a recipe's run stages (every executor: local copies, the SSH tar, the Slurm job folder):
    :func:`stage_plan` of ``workdir`` keeping the files the recipe names (:func:`recipe_files`), without the
    recipe's ``checkpoint_dir``: a checkpoint left in the work folder (an earlier run's, a copy-back) would make a
    new run silently resume from old state.  Later attempts of a run get broker's own copy
    (:mod:`broker.run.checkpoint` restores it after staging).  ``resume_checkpoint``: stage it (the user asked
    to start from it).  Raises FileNotFoundError when ``workdir`` is not a folder."""
    leave = {checkpoint_dir: CHECKPOINT_RULE} if checkpoint_dir and not resume_checkpoint else None
    plan = stage_plan(workdir, keep=recipe_files(workdir, script, args), leave_out=leave)
    if leave:
        # the folder's own files (links not followed: a link to it names the same files once)
        plan.checkpoint_files = sum(len(files) for _, _, files in os.walk(Path(workdir) / checkpoint_dir))
    elif checkpoint_dir:  # resume_checkpoint: say that the job starts from what is there (or that nothing is)
        top = Path(checkpoint_dir).as_posix().strip("/") + "/"
        plan.resumed_dir = top[:-1]
        plan.resumed_files = sum(1 for rel in plan.files if rel.as_posix().startswith(top))
    return plan


#: Linux ``FICLONE`` ioctl (``_IOW(0x94, 9, int)``): make ``dst`` share ``src``'s extents, copy-on-write
_FICLONE = 0x40049409
#: errors that mean "this filesystem (pair) cannot do that": fall back to the next way of copying
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EBADF}


class _CopyWays:
    """What the filesystems of one copy_staged call can do, learnt on the first file of each (source device,
    destination device) pair: the first refusal switches that pair to the next way for every later file (a failed
    ioctl per file would cost as much as the copy).  ``dst_dev``: the destination folder's device (every copy lands
    there: one stat, not one per file); ``umask``: the process's (None when unknown: then every file is chmod-ed)."""

    def __init__(self, dst_dev: int = -1, umask: int | None = None) -> None:
        self.no_clone: set[tuple[int, int]] = set()
        self.no_range: set[tuple[int, int]] = set()
        self.cloned = self.ranged = self.copied = 0
        self.clone_refused = 0  # the errno of the first refused reflink (EXDEV: two filesystems), 0 for none
        self.dst_dev = dst_dev
        self.umask = umask


def _umask() -> int | None:
    """This process's umask, read without changing it (``/proc/self/status``, Linux 4.7+); None when unknown."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _copy_file(src: str, dst: str, ways: _CopyWays) -> None:
    """``dst`` (created, never existing) gets ``src``'s bytes, its owner's permission bits and its times.

    In order: a reflink (``FICLONE``: the node's copy shares the blocks copy-on-write, so it costs no data copy and
    a node writing to it changes its own blocks only), then ``copy_file_range`` (an in-kernel copy), then plain
    reads and writes.  Never a hard link: a job writing to a linked file in place would change the user's own
    source file.  Six system calls for a small file (open, fstat, open, copy_file_range, utimensat, two closes;
    a chmod only when the umask takes owner bits): the file is created with its final mode."""
    import fcntl

    sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(sfd)
        mode = st.st_mode & 0o700  # the owner's bits: a node folder is private
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            pair = (st.st_dev, ways.dst_dev)
            done = st.st_size == 0
            if not done and pair not in ways.no_clone:
                try:
                    fcntl.ioctl(dfd, _FICLONE, sfd)
                    done = True
                    ways.cloned += 1
                except OSError as e:
                    if e.errno not in _UNSUPPORTED:
                        raise
                    ways.no_clone.add(pair)
                    ways.clone_refused = ways.clone_refused or e.errno
            if not done and pair not in ways.no_range:
                try:
                    left = st.st_size
                    while left > 0:
                        n = os.copy_file_range(sfd, dfd, left)
                        if n == 0:
                            break
                        left -= n
                    done = True
                    ways.ranged += 1
                except OSError as e:
                    if e.errno not in _UNSUPPORTED:
                        raise
                    ways.no_range.add(pair)
                    os.lseek(sfd, 0, os.SEEK_SET)
                    os.ftruncate(dfd, 0)
                    os.lseek(dfd, 0, os.SEEK_SET)
            if not done:
                while True:
                    chunk = os.read(sfd, 1 << 20)
                    if not chunk:
                        break
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(dfd, view):]
                ways.copied += 1
            if ways.umask is None or mode & ways.umask:  # the umask took bits of the mode asked for at creation
                os.fchmod(dfd, mode)
            os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def copy_staged(plan: StagePlan, dst: Path) -> dict[str, int]:
    """Copy the planned files into ``dst`` (created; an existing ``dst`` is replaced).  Every staged path becomes a
    regular file of its own (a linked file's content is copied) with the source's owner permission bits (group
    and others get none: the copy lies in a private run folder) and times; the folders are created 0700.

    A reflink where the filesystem allows one (btrfs, XFS, ...), else an in-kernel copy, else reads and writes
    (:func:`_copy_file`); never a hard link, so whatever a node writes into its work folder never reaches the
    user's files.  Returns how many files went each way, ``{"reflink": n, "copy_file_range": n, "copy": n}``, and
    ``"reflink_refused"``: the errno of the filesystem's first refusal of a reflink (``errno.EXDEV``: the work folder
    and ``dst`` are on two filesystems), 0 when none was refused (:func:`copy_hint` explains a slow copy with it).

    Cost on ext4 (no reflinks; bench/staging_scale.py, docs/staging.md): the system calls of creating each file
    dominate, so the loop does no per-file ``pathlib`` work, no stat of the copy and no chmod (the file is created
    with its mode).  A hard link would be one system call per file but shares the inode (a rank writing into a
    staged file in place would change the user's file); threads measured slower (the GIL and the filesystem's
    journal serialise the creations); a bind or overlay mount of the work folder would show the files the staging
    rules exclude (secrets, ignored files) and needs root."""
    from broker.core.private import DIR_MODE, private_dirs

    if dst.exists():
        shutil.rmtree(dst)
    private_dirs(dst)  # 0700 (and the node folder above it): a copy of the user's files in the run folder
    base = os.fspath(dst)
    ways = _CopyWays(os.stat(base).st_dev, _umask())
    made: set[str] = {""}
    root = os.fspath(plan.root)
    sources = plan.sources
    for rel in plan.files:
        r = rel.as_posix()
        parent = r.rpartition("/")[0]
        if parent not in made:  # one mkdir per folder, not one per file; parents first
            parts = parent.split("/")
            for k in range(1, len(parts) + 1):
                sub = "/".join(parts[:k])
                if sub not in made:
                    try:
                        os.mkdir(f"{base}/{sub}", DIR_MODE)
                    except FileExistsError:
                        if not os.path.isdir(f"{base}/{sub}"):
                            raise
                    made.add(sub)
        src = sources.get(rel)
        _copy_file(f"{root}/{r}" if src is None else os.fspath(src), f"{base}/{r}", ways)
    return {"reflink": ways.cloned, "copy_file_range": ways.ranged, "copy": ways.copied,
            "reflink_refused": ways.clone_refused}


def _mount(path: "str | os.PathLike[str]") -> tuple[str, str]:
    """(type, source) of the filesystem that holds ``path`` (``("ext4", "/dev/vda")``), ``("", "")`` when unknown
    (no such path, not Linux).  From ``/proc/self/mountinfo``: the mount whose device is ``path``'s, else (btrfs
    gives its files an anonymous device of their own) the mount with the longest mount point above ``path``, as
    ``findmnt --target`` does; the last one mounted wins.  Never raises."""
    try:
        real = os.path.realpath(path)
        dev = os.stat(real).st_dev
        want = f"{os.major(dev)}:{os.minor(dev)}"
        by_dev, by_dir, depth = ("", ""), ("", ""), -1
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                head, sep, tail = line.partition(" - ")
                fields, rest = head.split(), tail.split()
                if not sep or len(fields) < 5 or not rest:
                    continue
                found = (rest[0], rest[1] if len(rest) > 1 else "")
                if fields[2] == want:
                    by_dev = found
                point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= depth:
                    by_dir, depth = found, len(point)
        return by_dev if by_dev[0] else by_dir
    except (OSError, ValueError):
        return "", ""


def fs_type(path: "str | os.PathLike[str]") -> str:
    """The type of the filesystem that holds ``path`` (``ext4``, ``xfs``, ``btrfs``, ...), '' when unknown (no such
    path, not Linux; :func:`_mount`).  Never raises."""
    return _mount(path)[0]


def ext4_without_journal(path: "str | os.PathLike[str]", proc: str = "/proc/fs") -> bool:
    """True when ``path`` is on an ext4 filesystem mounted without a journal: the kernel lists the mount's device
    under ``/proc/fs/ext4/<dev>`` and its journal under ``/proc/fs/jbd2/<dev>-<n>``, and there is no such journal.
    False when it has one, is not ext4, or that cannot be told.  Never raises.

    Why it matters: without a journal, ext4 does not reuse the inode of a file deleted in the last 60 s (360 s
    while the inode's table block is not yet written back) and scans past every such free inode for each new one
    (Linux ``fs/ext4/ialloc.c``, ``recently_deleted``): 20,000 files take 9-14 s to create right after 40,000
    were deleted, for ``cp -a`` as much as for broker, against 0.65 s otherwise (bench/staging_scale.py)."""
    kind, source = _mount(path)
    if kind != "ext4":
        return False
    try:
        # the kernel's name for the device: /dev/mapper/vg-root is dm-0 there (/sys/dev/block/MAJ:MIN links to it)
        st = os.stat(os.path.realpath(path))
        link = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        names = [os.path.basename(os.readlink(link)) if os.path.islink(link) else "", os.path.basename(source)]
        dev = next((n for n in names if n and os.path.isdir(f"{proc}/ext4/{n}")), "")
        if not dev:
            return False
        journals = os.listdir(f"{proc}/jbd2") if os.path.isdir(f"{proc}/jbd2") else []
    except OSError:
        return False
    return not any(j.rpartition("-")[0] == dev for j in journals)


#: a local copy of the work folder slower than this (seconds, every node together) gets :func:`copy_hint`'s line
SLOW_COPY_S = 3.0


def copy_hint(ways: dict[str, int], seconds: float, nnodes: int, src: Path, dst: Path) -> str:
    """Why copying the work folder into ``nnodes`` node folders took ``seconds``, and what makes it fast: '' when
    it was quick (under :data:`SLOW_COPY_S`) or the files were reflinked.  ``ways``: :func:`copy_staged`'s counts
    (summed over the nodes); ``src``: the work folder; ``dst``: a node's folder in the run folder (the broker
    home).  Measured (bench/staging_scale.py, docs/staging.md): 20,000 small files take about a second where they
    are reflinked (XFS with reflink=1, btrfs), and several seconds per node where every byte is copied."""
    files = ways.get("reflink", 0) + ways.get("copy_file_range", 0) + ways.get("copy", 0)
    if seconds < SLOW_COPY_S or ways.get("reflink", 0) or not files:
        return ""
    head = (f"copying the work folder to {nnodes} node(s) took {seconds:.1f} s ({files // max(nnodes, 1):,} files "
            f"per node, each a full copy)")
    there, here = fs_type(src) or "its filesystem", fs_type(dst) or "its filesystem"
    if ways.get("reflink_refused") == errno.EXDEV:
        why = (f"the work folder ({there}) and the run folders in the broker home ({here}) are on two "
               f"filesystems, so no file could be cloned; with BROKER_HOME on the work folder's filesystem, one "
               f"with reflinks (XFS, btrfs) clones them copy-on-write in about a second")
    else:
        why = (f"{here} has no reflinks (copy-on-write clones); with the work folder and BROKER_HOME on one XFS "
               f"(reflink=1) or btrfs filesystem they are cloned in about a second")
        if ext4_without_journal(dst):
            why = ("this ext4 has no journal, so for some minutes after many files were deleted (broker clean, "
                   "rm -rf) it is slow to create new ones, for cp -a as much as for broker; " + why)
    return f"{head}: {why}; or leave out what the job does not need with a .brokerignore"


# the staged files packed as one tar (SSH and Slurm uploads) live in broker.run.stagetar; importable from here
from broker.run.stagetar import (COMPRESSED_SUFFIXES, StagedTar, staged_tar, tar_staged,  # noqa: E402,F401
                                 worth_compressing, write_tar)
