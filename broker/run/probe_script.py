"""Network and environment probe run ON the nodes by preflight (stdlib only: copied as-is and run with the node's
python; it must not import broker).

    python3 probe.py info PRIVATE_IP [PATH]           -> one JSON line: Python, torch, CUDA, NCCL, interfaces (IPv4
                                                         and IPv6), MTU, free disk at PATH, host firewall rules
                                                         (iptables, nftables, firewalld; read as root: `sudo -n`
                                                         on a non-root login)
    python3 probe.py listen TIMEOUT_S HITS PORT...    -> first line JSON {"ports": [...]} (0 = a random free port);
                                                         exits after every port was hit HITS times or TIMEOUT_S
    python3 probe.py connect TIMEOUT_S HOST PORT...   -> one JSON line per port: OPEN | FILTERED | REFUSED | ...
    python3 probe.py kill PIDFILE GRACE_S [K=V...]    -> SIGTERM the process group named in PIDFILE, every
                                                         descendant (torchrun starts its workers in new sessions)
                                                         and every process whose environment holds all K=V
                                                         (orphans), SIGKILL what is left after GRACE_S

Probe design (measured in docs/reference/local-cluster.md section 3): a real listener on the master port and on a random
ephemeral port; a connect with a 2 s timeout: OPEN answers in milliseconds, FILTERED (no answer: packets dropped by
a firewall DROP rule or a cloud security rule) after exactly the timeout, REFUSED (RST or ICMP unreachable while a
listener runs: a REJECT rule) at once.
"""

import errno
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time


def _run(argv, timeout=5.0):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return -1, str(e)


def _ifaces():
    """{ifname: {"addrs": [ip, ...], "mtu": int}} from `ip -o -4 addr` (falls back to /sys for MTU)."""
    out = {}
    rc, text = _run(["ip", "-o", "-4", "addr", "show"])
    if rc == 0:
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "inet":
                name = parts[1].split("@")[0]
                out.setdefault(name, {"addrs": [], "mtu": None})["addrs"].append(parts[3].split("/")[0])
    for name in list(out) + [n for n in _sys_ifaces() if n not in out]:
        entry = out.setdefault(name, {"addrs": [], "mtu": None})
        if rc != 0 and not entry["addrs"]:  # no `ip` on this node: ask the kernel (SIOCGIFADDR, primary only)
            addr = _ioctl_addr(name)
            if addr:
                entry["addrs"].append(addr)
        try:
            with open(f"/sys/class/net/{name}/mtu") as f:
                entry["mtu"] = int(f.read().strip())
        except (OSError, ValueError):
            pass
    return out


def _ifaces6():
    """{ifname: [ipv6 address, ...]} from `ip -o -6 addr` (link-local fe80:: left out)."""
    out = {}
    rc, text = _run(["ip", "-o", "-6", "addr", "show"])
    if rc != 0:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet6" and not parts[3].lower().startswith("fe80"):
            out.setdefault(parts[1].split("@")[0], []).append(parts[3].split("/")[0])
    return out


def _cidrs():
    """{ifname: ["10.0.0.5/24", ...]} (IPv4 with prefix: the private network's CIDR for firewall commands)."""
    out = {}
    rc, text = _run(["ip", "-o", "-4", "addr", "show"])
    if rc == 0:
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "inet":
                out.setdefault(parts[1].split("@")[0], []).append(parts[3])
    return out


def _as_root(argv):
    """argv run as root: as is for root, through `sudo -n` (never prompts) otherwise."""
    if os.geteuid() == 0:
        return argv
    return ["sudo", "-n"] + argv


def _tool(name):
    for d in ("", "/usr/sbin/", "/sbin/", "/usr/bin/"):
        path = shutil.which(name) if not d else d + name
        if path and os.path.exists(path):
            return path
    return None


def firewall():
    """Host firewall rules as root: {"as_root": bool, "iptables": text|None, "iptables_error": str|None,
    "nft": text|None, "nft_error": ..., "firewalld": {"state": ..., "zone": ..., "list": text}|None}."""
    res = {"as_root": os.geteuid() == 0, "iptables": None, "iptables_error": None, "nft": None, "nft_error": None,
           "firewalld": None}
    ipt = _tool("iptables")
    if ipt:
        rc, text = _run(_as_root([ipt, "-S"]), timeout=5)
        if rc == 0:
            res["iptables"] = text
        else:
            res["iptables_error"] = text.strip()[-200:] or "exit %d" % rc
    nft = _tool("nft")
    if nft:
        rc, text = _run(_as_root([nft, "list", "ruleset"]), timeout=5)
        if rc == 0:
            res["nft"] = text
        else:
            res["nft_error"] = text.strip()[-200:] or "exit %d" % rc
    fwc = _tool("firewall-cmd")
    if fwc:
        rc, state = _run(_as_root([fwc, "--state"]), timeout=5)
        fw = {"state": state.strip() or "exit %d" % rc}
        if rc == 0:
            _, zone = _run(_as_root([fwc, "--get-default-zone"]), timeout=5)
            fw["zone"] = zone.strip()
            _, lst = _run(_as_root([fwc, "--list-all"]), timeout=5)
            fw["list"] = lst
        res["firewalld"] = fw
    return res


def disk_free(path):
    """Free bytes on the filesystem holding PATH (its nearest existing parent)."""
    p = os.path.abspath(os.path.expanduser(path or "~"))
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    try:
        u = shutil.disk_usage(p)
        return {"path": p, "free_bytes": u.free, "total_bytes": u.total}
    except OSError as e:
        return {"path": p, "error": str(e)}


def _ioctl_addr(name):
    import fcntl
    import struct
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(raw[20:24])
    except OSError:
        return None
    finally:
        s.close()


def _sys_ifaces():
    try:
        return os.listdir("/sys/class/net")
    except OSError:
        return []


def _torch_files():
    """torch's facts read from its installed files, without importing it (``import torch`` takes seconds of a
    node's start-up, and the job imports it again right after): ``{"torch_error": ...}`` when there is no torch
    (the words ``import torch`` says); for a CPU build (``torch/version.py`` names no CUDA or ROCm) the whole answer
    the import gives (no GPU, no NCCL); None for a GPU build or files that cannot be read: then only the import
    answers (devices visible, NCCL version).  A CPU build whose import is broken is caught by the job's own start
    (its traceback in the node log, the run's reason and diagnosis)."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError) as e:
        return {"torch_error": "%s: %s" % (type(e).__name__, e)}
    if spec is None:
        return {"torch_error": "ModuleNotFoundError: No module named 'torch'"}
    folders = list(spec.submodule_search_locations or [])
    if not folders:
        return None
    facts = {}
    try:
        with open(os.path.join(folders[0], "version.py"), encoding="utf-8") as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.AnnAssign):
                    target, value = node.target, node.value
                elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target, value = node.targets[0], node.value
                else:
                    continue
                if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                    facts[target.id] = value.value
    except (OSError, SyntaxError, ValueError):
        return None
    if not isinstance(facts.get("__version__"), str) or "cuda" not in facts \
            or any(facts.get(k) for k in ("cuda", "hip", "rocm", "xpu")):
        return None
    return {"torch": facts["__version__"], "cuda": False, "cuda_version": None, "gpus": 0, "gpu_names": [],
            "nccl": False, "nccl_version": None, "torch_from": "files"}


def _torch_import(res):
    """torch's facts from ``import torch`` in a child (its devices, CUDA and NCCL versions) into ``res``, or
    ``torch_error``: the import's last line of error."""
    code = ("import json,torch;c=torch.cuda.is_available();"
            "print(json.dumps({'torch':torch.__version__,'cuda':c,'cuda_version':torch.version.cuda,"
            "'gpus':torch.cuda.device_count() if c else 0,"
            "'gpu_names':[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if c else [],"
            "'nccl':torch.distributed.is_nccl_available() if torch.distributed.is_available() else False,"
            "'nccl_version':'.'.join(map(str,torch.cuda.nccl.version())) if torch.version.cuda else None}))")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        if p.returncode == 0 and p.stdout.strip():
            res.update(json.loads(p.stdout.strip().splitlines()[-1]))
        else:
            res["torch_error"] = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        res["torch_error"] = str(e)


def info(private_ip, disk_path=None):
    res = {"hostname": socket.gethostname(), "python": sys.executable, "pyversion": sys.version.split()[0]}
    t0 = time.time()
    light = _torch_files()
    if light is not None:
        res.update(light)
    else:
        _torch_import(res)
    res["torch_import_s"] = round(time.time() - t0, 2)
    ifs = _ifaces()
    res["ifaces"] = ifs
    res["private_iface"] = next((n for n, e in ifs.items() if private_ip in e["addrs"]), None)
    six = _ifaces6()
    res["ifaces6"] = six
    if res["private_iface"] is None:
        res["private_iface6"] = next((n for n, a in six.items() if private_ip in a), None)
    res["cidrs"] = _cidrs()
    fw = firewall()
    res["firewall"] = fw
    res["iptables"] = fw["iptables"]
    res["iptables_error"] = fw["iptables_error"]
    res["disk"] = disk_free(disk_path)
    return res


def listen(timeout_s, hits, ports):
    socks = []
    for p in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", p))
        except OSError as e:
            print(json.dumps({"error": "cannot listen on port %d: %s" % (p, e.strerror), "port": p}), flush=True)
            return 3
        s.listen(64)
        s.setblocking(False)
        socks.append(s)
    print(json.dumps({"ports": [s.getsockname()[1] for s in socks]}), flush=True)
    count = {s: 0 for s in socks}
    end = time.time() + timeout_s
    while time.time() < end and any(c < hits for c in count.values()):
        r, _, _ = select.select(socks, [], [], max(0.0, min(0.5, end - time.time())))
        for s in r:
            try:
                c, _ = s.accept()
                c.close()
                count[s] += 1
            except OSError:
                pass
    return 0


def connect(timeout_s, host, ports):
    for p in ports:
        t0 = time.time()
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        try:
            s.connect((host, p))
            state, detail = "OPEN", ""
        except socket.timeout:
            state, detail = "FILTERED", "no answer: packets dropped"
        except ConnectionRefusedError:
            state, detail = "REFUSED", "connection refused (RST or ICMP port-unreachable)"
        except OSError as e:
            if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                state = "UNREACHABLE"
            elif e.errno == errno.ETIMEDOUT:
                state = "FILTERED"
            else:
                state = "ERROR"
            detail = e.strerror or str(e)
        finally:
            s.close()
        print(json.dumps({"host": host, "port": p, "state": state, "detail": detail,
                          "seconds": round(time.time() - t0, 3)}), flush=True)
    return 0


def _procs():
    """{pid: (ppid, pgid)} of every process (Linux /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                rest = f.read().rsplit(")", 1)[1].split()
            if rest[0] == "Z":  # exited, not yet reaped
                continue
            out[int(d)] = (int(rest[1]), int(rest[2]))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _marked(procs, markers):
    if not markers:
        return set()
    want = [m.encode() for m in markers]
    out = set()
    for p in procs:
        try:
            with open("/proc/%d/environ" % p, "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if all(m in env for m in want):
            out.add(p)
    return out


def _tree(pgid, markers=()):
    procs = _procs()
    marked = _marked(procs, markers)
    # the pid file's group id outlives the job and may be reused: with markers, a member of that group counts only
    # when it carries them (the job's processes do; their children are added below whatever their environment)
    found = {p for p, (_, g) in procs.items() if pgid is not None and g == pgid and (not markers or p in marked)}
    found |= marked
    changed = True
    while changed:
        changed = False
        for p, (pp, _) in procs.items():
            if pp in found and p not in found:
                found.add(p)
                changed = True
    found.discard(os.getpid())
    return found


def _signal_all(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


def kill(pidfile, grace_s, markers=()):
    import signal
    try:
        with open(pidfile) as f:
            pgid = int(f.read().strip())
    except (OSError, ValueError):
        pgid = None
    first = _tree(pgid, markers)
    _signal_all(first, signal.SIGTERM)
    end = time.time() + grace_s
    while time.time() < end and _tree(pgid, markers):
        time.sleep(0.1)
    left = _tree(pgid, markers)
    _signal_all(left, signal.SIGKILL)
    print(json.dumps({"terminated": sorted(first), "killed": sorted(left)}), flush=True)
    return 0


def main(argv):
    mode = argv[1]
    if mode == "info":
        print(json.dumps(info(argv[2], argv[3] if len(argv) > 3 else None)), flush=True)
        return 0
    if mode == "listen":
        return listen(float(argv[2]), int(argv[3]), [int(x) for x in argv[4:]])
    if mode == "connect":
        return connect(float(argv[2]), argv[3], [int(x) for x in argv[4:]])
    if mode == "kill":
        return kill(argv[2], float(argv[3]), argv[4:])
    print("unknown mode %r" % mode, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
