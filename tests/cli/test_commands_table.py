"""Every command of broker is a module-level function reachable by its dotted name (grep and tests find it), added
from one table (broker.cli.app.COMMAND_TABLE), and answers ``--help`` through the real entry point."""

from __future__ import annotations

import importlib
import signal

import pytest

from broker.cli import app as cli


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return importlib.import_module(module), attr, getattr(importlib.import_module(module), attr)


def _is_group(obj) -> bool:
    return hasattr(obj, "registered_commands")


def _module_level(fn, module) -> bool:
    """``fn`` is defined at the top of ``module`` (not inside a function) and reachable there by its name."""
    return fn.__qualname__ == fn.__name__ and fn.__module__ == module.__name__ and getattr(module, fn.__name__) is fn


def command_paths() -> list[tuple[tuple[str, ...], str]]:
    """(command path, "module:function") of every command in the table and every subcommand of its groups."""
    out = []
    for name, target, _ in cli.COMMAND_TABLE:
        module, attr, obj = _resolve(target)
        if attr == "register":  # a module that adds its command itself: its row still names where it is
            out.append(((name,), target))
        elif _is_group(obj):
            for c in obj.registered_commands:
                out.append(((name, c.name), f"{module.__name__}:{c.callback.__name__}"))
        else:
            out.append(((name,), target))
    return out


PATHS = command_paths()


@pytest.mark.parametrize("path,target", PATHS, ids=[" ".join(p) for p, _ in PATHS])
def test_each_command_is_a_module_level_function(path, target):
    module, attr, fn = _resolve(target)
    assert callable(fn) and not _is_group(fn)
    assert _module_level(fn, module), f"broker {' '.join(path)}: {target} is not a module-level function"


def test_the_table_is_what_broker_help_lists():
    """The full app holds exactly the table's commands, in its order (groups after commands, as Typer lists them),
    and each row's module is the one COMMANDS names for the lazy start."""
    import typer.main

    full = typer.main.get_command(cli.make_app(cli.COMMAND_MODULES))
    names = [n for n, _, _ in cli.COMMAND_TABLE]
    assert len(names) == len(set(names))
    assert set(full.commands) == set(names)
    assert cli.COMMANDS == {n: t.partition(":")[0] for n, t, _ in cli.COMMAND_TABLE}
    for name, target, _ in cli.COMMAND_TABLE:  # built alone (`broker NAME ...`): the command and no other
        alone = typer.main.get_command(cli.make_app([target.partition(":")[0]]))
        assert name in alone.commands


@pytest.fixture
def own_signals():
    """cli.main installs its SIGINT / SIGTERM / SIGHUP handlers: put the test process's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.parametrize("path", [p for p, _ in PATHS], ids=[" ".join(p) for p, _ in PATHS])
def test_help_of_each_command(path, own_signals, capsys, tmp_path, monkeypatch):
    """``broker <cmd> [<sub>] --help`` through the console entry (the app built for that command only): exit 0,
    the command's own usage line."""
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        cli.main([*path, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert out.startswith(f"Usage: broker {' '.join(path)} "), out[:200]


def test_a_group_whose_short_help_names_its_commands_names_all_of_them():
    """`broker --help` read "Slurm clusters: render, up, status, down": submit, the command for a learner's own
    sbatch file, was missing.  A group's one-line help that names two or more of its commands names every one."""
    import re

    for name, target, kw in cli.COMMAND_TABLE:
        _, _, obj = _resolve(target)
        if not _is_group(obj):
            continue
        subs = {c.name for c in obj.registered_commands}
        words = set(re.findall(r"[a-z]+", (kw or {}).get("short_help", "")))
        if len(words & subs) >= 2:
            assert subs <= words, f"broker {name}'s short help leaves out {sorted(subs - words)}"


def test_broker_slurm_help_describes_every_command_it_lists():
    """`broker slurm --help` described only render ("Slurm clusters: render the sbatch script of a recipe") above
    a list of five commands: its description now says what each one is for."""
    import re

    from broker.cli.slurm import slurm_app

    words = set(re.findall(r"[a-z]+", slurm_app.info.help or ""))
    subs = {c.name for c in slurm_app.registered_commands}
    assert subs == {"up", "submit", "status", "down", "render"}
    assert subs <= words, sorted(subs - words)
