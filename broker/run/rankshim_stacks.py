"""Reading the ranks' stacks on a node (stdlib only; shipped beside ``rankshim.py``, run as ``rankshim.py
--dump-stacks DIR``): every live rank of a facts folder is asked for its Python stacks (``py-spy dump`` where
installed, else ``SIGUSR1``, on which the shim armed :mod:`faulthandler`), with its forked DataLoader workers', its
CPU and CPU-wait time from /proc, the source lines of the frames; a rank inside ``init_process_group`` is never
signalled (its place comes from its facts).  The answer is JSON framed in short tagged lines (:func:`frame_answer`)
for :mod:`broker.run.stall`."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

#: the signal on which a rank dumps its Python stacks (torchelastic uses SIGTERM/SIGINT/SIGHUP/SIGQUIT, not this)
STACK_SIGNAL = signal.SIGUSR1


_FRAME_FILES = re.compile(r'File "([^"]+)", line (\d+)|\(([^()]+):(\d+)\)\s*$', re.M)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not a rank that can answer
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _cpu_s(pid):
    """CPU seconds used so far by ``pid`` and its live children (DataLoader workers), from /proc (None when
    unreadable).  A rank blocked in a collective or a sleep uses ~none; one that computes uses a core."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def stat(p):
        with open("/proc/%s/stat" % p) as f:
            return f.read().rsplit(")", 1)[-1].split()

    try:
        fields = stat(pid)
    except (OSError, IndexError):
        return None
    total = int(fields[11]) + int(fields[12])  # utime, stime
    try:
        for name in os.listdir("/proc"):
            if name.isdigit() and name != str(pid):
                try:
                    f = stat(name)
                    if f[1] == str(pid):  # ppid
                        total += int(f[11]) + int(f[12])
                except (OSError, IndexError, ValueError):
                    continue
    except OSError:
        pass
    return total / float(tick)


def _wait_s(pid):
    """Seconds the threads of ``pid`` have spent runnable but waiting for a CPU (``/proc/PID/task/*/schedstat``'s
    second field; None when unreadable).  On a loaded machine a computing rank gets little CPU but waits for it:
    CPU used plus this wait is what it asked for, whatever the load."""
    total, seen = 0, False
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for t in tasks:
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
                total += int(f.read().split()[1])
                seen = True
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9 if seen else None


def _code_lines(pid, text):
    """``{"file:line": source}`` for the frames in ``text`` (relative names resolved in the rank's own folder)."""
    import linecache
    out = {}
    for m in _FRAME_FILES.finditer(text):
        name, line = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        key = "%s:%s" % (name, line)
        if key in out or name.startswith("<"):
            continue
        path = name if os.path.isabs(name) else os.path.join("/proc/%d/cwd" % pid, name)
        code = linecache.getline(path, int(line)).strip()
        if code:
            out[key] = code[:300]
    return out


_SETS_MASTER = re.compile(r"""environ\s*\[\s*['"]MASTER_(ADDR|PORT)['"]\s*\]\s*=[^=]|"""
                         r"""(update|putenv)\s*\(.*MASTER_(ADDR|PORT)""")


def _master_lines(pid, script):
    """``[[line, source]]`` of the script's lines that set MASTER_ADDR/MASTER_PORT (``os.environ[...] = ``,
    ``os.environ.update``, ``os.putenv``; ``setdefault`` keeps torchrun's value and is not one)."""
    if not script:
        return []
    path = script if os.path.isabs(script) else os.path.join("/proc/%d/cwd" % pid, script)
    out = []
    try:
        with open(path, errors="replace") as f:
            for i, line in enumerate(f, 1):
                if _SETS_MASTER.search(line.split("#", 1)[0]):
                    out.append([i, line.strip()[:200]])
                    if len(out) >= 8:
                        break
    except OSError:
        pass
    return out


#: DataLoader workers (forked children of a rank) whose stacks are read per rank
WORKERS_CAP = 8


def _children(pid):
    """Live child pids of ``pid`` (its forked DataLoader workers, among others), from /proc."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit() and name != str(pid):
            try:
                with open("/proc/%s/stat" % name) as f:
                    fields = f.read().rsplit(")", 1)[-1].split()
                if fields[1] == str(pid) and fields[0] != "Z":
                    out.append(int(name))
            except (OSError, IndexError, ValueError):
                continue
    return sorted(out)


def _catches(pid, sig):
    """Whether ``pid`` has a handler for ``sig`` (``/proc/PID/status`` SigCgt): a forked DataLoader worker keeps the
    faulthandler its rank armed; a child that exec'd another program does not, and the signal would end it."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _cmdline(pid):
    """``/proc/PID/cmdline`` (None when unreadable): a forked child keeps its parent's."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read()
    except OSError:
        return None


def _signalled_dump(path, pid, wait_s):
    """Signal ``pid`` (it appends its stacks to ``path``) and return what it appended ('' when nothing came)."""
    try:
        size = os.path.getsize(path)
        os.kill(pid, STACK_SIGNAL)
    except OSError:
        return ""
    end, last = time.time() + wait_s, None
    while time.time() < end:
        time.sleep(0.05)
        try:
            now = os.path.getsize(path)
        except OSError:
            return ""
        if now > size and now == last:  # grown, and stopped growing
            break
        last = now
    try:
        with open(path, errors="replace") as f:
            f.seek(size)
            return f.read(256 * 1024)
    except OSError:
        return ""


def _worker_stacks(facts_dir, info, pyspy, wait_s=1.0):
    """``[{"pid", "text", "code"}]``: the stacks of a rank's forked DataLoader workers (a worker stuck in the
    dataset's code leaves its rank waiting for a batch).  Each worker kept the rank's faulthandler and stack file
    across the fork, so one at a time it is signalled and its dump read from the file's new end; py-spy reads
    them where it is installed.  A child that does not catch the signal, or whose command line is not its rank's
    (an exec'd program), is never signalled."""
    out = []
    for child in _children(info["pid"])[:WORKERS_CAP]:
        text = _pyspy_dump(pyspy, child) if pyspy else ""
        if not text.strip() and info.get("stack_file") and _catches(child, STACK_SIGNAL) \
                and _cmdline(child) == _cmdline(info["pid"]):  # a fork of the rank (a worker), not another program
            text = _signalled_dump(os.path.join(facts_dir, info["stack_file"]), child, wait_s)
        if text.strip():
            out.append({"pid": child, "text": text, "code": _code_lines(info["pid"], text)})
    return out


def _read_ranks(facts_dir):
    """The ranks of ``facts_dir`` (its ``rank*.json`` on this host) in three groups: ``(live ranks to sample, ended
    ranks, ranks inside init_process_group)``, each ``{rank: entry}``; the last two are complete answers (the
    rendezvous is never signalled: its place comes from the facts)."""
    ranks, ended, ranks_in_init = {}, {}, {}
    try:
        names = sorted(os.listdir(facts_dir))
    except OSError:
        return {}, {}, {}
    for name in names:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(facts_dir, name)) as f:
                d = json.load(f)
            pid = int(d["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if d.get("host") not in (None, socket.gethostname()):
            continue  # a facts folder shared by several hosts (Slurm): another host's pid means nothing here
        if "ended" in d or not _alive(pid):
            exc = d.get("exception") or {}
            ended[str(d.get("rank", name[4:-5]))] = {"pid": pid, "node": d.get("node"), "ended": True,
                                                     "exit_code": d.get("exit_code"), "exception": exc.get("type"),
                                                     "frame": exc.get("frame"), "seq": d.get("seq")}
            continue
        if d.get("init_started") and not d.get("init_done"):
            # in the rendezvous: no signal (it would interrupt the store's connect, which torch logs and retries);
            # its place is the line that called init_process_group, with the addresses it was given
            at = d.get("init_at") if isinstance(d.get("init_at"), dict) else {}
            init = {"at": at, "master": d.get("master"), "init_master": d.get("init_master"),
                    "init_method": d.get("init_method"), "host": d.get("host")}
            if d.get("init_master") and d.get("init_master") != d.get("master"):
                init["sets_master"] = _master_lines(pid, d.get("script"))
            code = _code_lines(pid, 'File "%s", line %s' % (at.get("file"), at.get("line"))) if at else {}
            ranks_in_init[str(d.get("rank", name[4:-5]))] = {
                "pid": pid, "node": d.get("node"), "tool": "facts", "init": init, "code": code, "seq": d.get("seq"),
                "cpu_s": _cpu_s(pid), "wait_s": _wait_s(pid), "t": time.time()}
            continue
        ranks[str(d.get("rank", name[4:-5]))] = {"pid": pid, "node": d.get("node"), "stack_file": d.get("stack_file"),
                                                 "seq": d.get("seq")}
    return ranks, ended, ranks_in_init


def _pyspy_dump(pyspy, pid):
    """``py-spy dump`` of ``pid`` ('' when it gives nothing): full file names tell the user's files from the
    libraries' (py-spy shortens them to the package part otherwise); an older py-spy without the option gets a
    second call without it."""
    for extra in (["--full-filenames"], []):
        try:
            p = subprocess.run([pyspy, "dump", "--pid", str(pid)] + extra, capture_output=True, text=True,
                               timeout=20)
        except (OSError, subprocess.SubprocessError):
            return ""
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout
    return ""


def dump_stacks(facts_dir, wait_s=3.0, use_pyspy=True):
    """Every live rank of ``facts_dir`` (from its ``rank*.json``): ``{rank: {"pid", "node", "tool", "text",
    "code"}}`` -- its Python stacks from ``py-spy dump`` when installed and allowed, else from the faulthandler the
    shim armed on SIGUSR1 (waits up to ``wait_s`` seconds for the dump to land).  A rank that has ended is
    ``{"pid", "node", "ended": True, "exit_code", "exception", "frame"}``; one that gave no stack is left out."""
    ranks, ended, ranks_in_init = _read_ranks(facts_dir)
    pyspy = shutil.which("py-spy") if use_pyspy else None
    sizes = {}
    for r, info in ranks.items():
        if pyspy:
            text = _pyspy_dump(pyspy, info["pid"])
            if text:
                info.update(tool="py-spy", text=text)
                continue
        if not info.get("stack_file"):
            continue
        path = os.path.join(facts_dir, info["stack_file"])
        try:
            sizes[r] = os.path.getsize(path)
        except OSError:
            sizes[r] = 0
        try:
            os.kill(info["pid"], STACK_SIGNAL)
        except OSError:
            sizes.pop(r)
    end = time.time() + wait_s
    pending = set(sizes)
    last = {}
    while pending and time.time() < end:
        time.sleep(0.1)
        for r in list(pending):
            try:
                size = os.path.getsize(os.path.join(facts_dir, ranks[r]["stack_file"]))
            except OSError:
                continue
            if size > sizes[r] and last.get(r) == size:  # grown, and stopped growing
                pending.discard(r)
            last[r] = size
    for r in sizes:
        try:
            with open(os.path.join(facts_dir, ranks[r]["stack_file"]), errors="replace") as f:
                f.seek(sizes[r])
                text = f.read(256 * 1024)
        except OSError:
            continue
        if text.strip():
            ranks[r].update(tool="faulthandler", text=text)
    out = dict(ended)
    out.update(ranks_in_init)
    for r, info in ranks.items():
        if info.get("text"):
            out[r] = {"pid": info["pid"], "node": info["node"], "tool": info["tool"], "text": info["text"],
                      "code": _code_lines(info["pid"], info["text"]), "cpu_s": _cpu_s(info["pid"]),
                      "seq": info.get("seq"),
                      "wait_s": _wait_s(info["pid"]),
                      "t": time.time()}
            workers = _worker_stacks(facts_dir, info, pyspy)
            if workers:
                out[r]["workers"] = workers
    return out


#: the tag of every line of a ``--dump-stacks`` answer (:func:`frame_answer`)
ANSWER_TAG = "broker-stacks"
#: characters of JSON per answer line: every line stays under the 1024 bytes that slurmstepd sends whole (a longer
#: line is cut into messages, and srun interleaves the pieces of its tasks: one answer per node, all at once)
ANSWER_CHUNK = 800


def frame_answer(text):
    """``text`` (one JSON document, ASCII, no newline) as short lines ``broker-stacks ID I/N CHUNK``: ``ID`` is
    unique to this answer and ends in the CRC-32 of ``text`` (8 hex digits), so answers of several nodes printed
    into one stream (``srun``'s tasks) are told apart and put back together whatever order their lines arrive in
    (:func:`broker.run.stall.stack_answers`)."""
    import zlib

    # host, pid and a nonce tell answers apart; the CRC-32 of the whole text, last, tells a damaged one
    ident = "%s-%d-%s-%08x" % (socket.gethostname().replace(" ", "_") or "host", os.getpid(), os.urandom(4).hex(),
                               zlib.crc32(text.encode()))
    chunks = [text[i:i + ANSWER_CHUNK] for i in range(0, len(text), ANSWER_CHUNK)] or [""]
    return "".join("%s %s %d/%d %s\n" % (ANSWER_TAG, ident, i + 1, len(chunks), c) for i, c in enumerate(chunks))
