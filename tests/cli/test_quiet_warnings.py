"""Third-party deprecation notices stay off the terminal: asyncssh's imports of DSA under cryptography 51 printed
five 224-column CryptographyDeprecationWarning blocks on every SSH command."""

from __future__ import annotations

import warnings

from broker.cli.app import quiet_third_party_warnings


class FakeCryptographyDeprecationWarning(UserWarning):
    """cryptography's own class derives from UserWarning; importing it is not needed to filter it."""


def test_warnings_raised_from_asyncssh_are_not_shown_and_broker_s_own_still_are():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_third_party_warnings()
        for module in ("asyncssh.crypto.misc", "asyncssh.crypto.dsa", "asyncssh"):
            warnings.warn_explicit("DSA is deprecated", FakeCryptographyDeprecationWarning, "misc.py", 32,
                                   module=module)
        warnings.warn_explicit("a broker warning", UserWarning, "recipe.py", 1, module="broker.core.recipe")
        warnings.warn_explicit("not asyncssh", UserWarning, "x.py", 1, module="asyncsshx")
    assert [str(w.message) for w in seen] == ["a broker warning", "not asyncssh"]


def test_the_cli_sets_the_filter_for_every_command():
    import subprocess
    import sys

    code = ("import warnings\n"
            "from broker.cli import app\n"
            "try:\n    app.main(['--version'])\nexcept SystemExit:\n    pass\n"
            "warnings.warn_explicit('DSA is deprecated', UserWarning, 'misc.py', 32, module='asyncssh.crypto.misc')\n"
            "warnings.warn_explicit('a broker warning', UserWarning, 'recipe.py', 1, module='broker.core.recipe')\n")
    cp = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=60)
    assert "DSA is deprecated" not in cp.stderr and "a broker warning" in cp.stderr, cp.stderr
