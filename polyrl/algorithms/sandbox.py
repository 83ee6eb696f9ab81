"""Run untrusted Python (a policy's generated code) against tests in a sandboxed child process; the ``code_exec``
reward (``polyrl.algorithms.rewards``) is built on ``run_tests``.

What the sandbox does, in order, in a fresh ``python -I`` process (its own session and process group, a new
temporary directory as its cwd and ``HOME``, an environment of ``PATH`` only, stdout/stderr discarded):

1. resource limits: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (largest file it
   may write), ``RLIMIT_NOFILE``;
2. no network: a new, empty network namespace (``unshare(CLONE_NEWNET)``; as non-root with a user namespace, where
   the kernel allows it). Where neither works, the network guard is only best-effort: ``socket.socket`` and
   ``socket.create_connection`` raise (code that reaches ``_socket`` or ``ctypes`` directly gets past that);
   ``SandboxResult.network_isolated`` says which one held;
3. as root: it drops to a fresh unprivileged uid (``UID_BASE`` + a random offset), keeping only
   ``CAP_DAC_READ_SEARCH`` so it can still read the interpreter's files, so ``RLIMIT_NPROC`` holds (the kernel does
   not apply it to root) and every process it left behind can be found and killed by uid. Where root lacks those
   capabilities (a default Docker container) it stays root: then only the process-group kill stops a fork bomb, at
   the timeout (``SandboxResult.own_uid`` says which). As another user, ``RLIMIT_NPROC`` is that user's current
   process count plus ``extra_processes`` (best-effort);
4. the solution is executed as a module named ``solution`` (so an ``if __name__ == "__main__":`` block does not
   run), then each test in the same namespace; or, for stdin/stdout tests, the solution runs as ``__main__`` once
   per case with that case's stdin (``sys.stdin``, ``sys.stdin.buffer``) and its printed output compared. Each
   result is streamed to the parent over a private pipe as it finishes, tagged with a per-run nonce, so a test that
   hangs still leaves the results before it.

On the wall-clock ``timeout`` (or when the tests finish), the whole process group (and, as root, every process of
the sandbox uid) is killed with SIGKILL. A limit that stops the code (memory, CPU, a fork bomb hitting
``RLIMIT_NPROC``) is a failing test, never an error of the run. The tests run in the same interpreter as the
solution: the sandbox contains damage to the machine, it does not make the pass count tamper-proof against code
written to forge it (keep reward hacking in mind when reading the numbers).
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

UID_BASE = 200_000  # sandbox uids (as root): UID_BASE + [0, 100000)

_FENCE_RE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The code of a completion: the last fenced block tagged ``python`` / ``py`` (else the last untagged fenced
    block), else the whole completion."""
    blocks = _FENCE_RE.findall(completion)
    tagged = [code for lang, code in blocks if lang]
    if tagged:
        return tagged[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def example_tests(example: Mapping[str, Any]) -> list[str] | list[dict[str, str]]:
    """The tests of a data row (or of the example dict a reward function gets, whose ``metadata`` holds the row's
    other fields). Read, first found wins:

    - ``tests`` or ``test_list``: a list of snippets, each one test run after the solution in its namespace (e.g.
      ``"assert add(1, 2) == 3"``, MBPP's field); a single string is one test;
    - ``test``: one test program (HumanEval's field; with ``entry_point``, ``check(<entry_point>)`` is appended);
    - ``input_output`` (APPS' field: a dict or its JSON text) or ``inputs`` + ``outputs``: lists of stdin texts and
      the stdout each must print; each pair is one test, the whole program run as ``__main__`` per pair, outputs
      compared token by token (whitespace-insensitive).

    ValueError when there are none."""
    sources = [example, example.get("metadata") or {}]
    for src in sources:
        for key in ("tests", "test_list"):
            value = src.get(key)
            if isinstance(value, str) and value.strip():
                return [value]
            if isinstance(value, Sequence) and not isinstance(value, str) and value:
                if not all(isinstance(t, str) for t in value):
                    raise ValueError(f"the row's {key!r} must be a list of strings (Python snippets)")
                return list(value)
    for src in sources:
        test = src.get("test")
        if isinstance(test, str) and test.strip():
            entry = src.get("entry_point")
            return [f"{test}\ncheck({entry})\n" if isinstance(entry, str) and entry else test]
    for src in sources:
        io_pairs = src.get("input_output")
        if isinstance(io_pairs, str) and io_pairs.strip():
            try:
                io_pairs = json.loads(io_pairs)
            except ValueError:
                raise ValueError("the row's 'input_output' is not JSON with 'inputs' and 'outputs' lists") from None
        if not isinstance(io_pairs, Mapping):
            io_pairs = {"inputs": src.get("inputs"), "outputs": src.get("outputs")}
        ins, outs = io_pairs.get("inputs"), io_pairs.get("outputs")
        if ins is None and outs is None:
            continue
        if (
            not (isinstance(ins, Sequence) and isinstance(outs, Sequence))
            or isinstance(ins, str)
            or len(ins) != len(outs)
        ):
            raise ValueError("the row's stdin/stdout tests need 'inputs' and 'outputs' lists of the same length")
        return [{"stdin": _text(i), "stdout": _text(o)} for i, o in zip(ins, outs)]
    raise ValueError(
        "the row has no tests: code_exec reads a 'tests' or 'test_list' list, a 'test' program, or 'input_output' "
        "/ 'inputs' + 'outputs' (stdin/stdout pairs)"
    )


def _text(value: Any) -> str:
    if isinstance(value, list):  # APPS stores some cases as lists of lines
        return "\n".join(str(v) for v in value)
    return str(value)


@dataclass
class SandboxResult:
    """How one sandboxed run went: ``passed`` of ``total`` tests; ``timed_out`` when the wall-clock limit killed it;
    ``code_error`` the solution's own exception (it failed before any test ran), if any."""

    passed: int
    total: int
    timed_out: bool = False
    code_error: str | None = None
    network_isolated: bool = False
    own_uid: bool = False  # ran under its own unprivileged uid (as root, where the capabilities allow it)
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


# The child: sets its limits, isolates itself, then runs the code and the tests. Reads one JSON object from stdin.
_HARNESS = r"""
import json, os, resource, sys
cfg = json.loads(sys.stdin.readline())
out = os.fdopen(cfg["fd"], "w", buffering=1)
nonce = cfg["nonce"]
def lim(kind, n):
    try:
        resource.setrlimit(kind, (n, n))
    except (ValueError, OSError):
        pass
isolated = 0
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
try:
    CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
    if os.geteuid() == 0 and libc.unshare(CLONE_NEWNET) == 0:
        isolated = 1
    elif os.geteuid() != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        isolated = 1
except Exception:
    pass
with open("/proc/self/status") as f:
    cap_eff = int(next((ln.split()[1] for ln in f if ln.startswith("CapEff:")), "0"), 16)
drop = os.geteuid() == 0 and cfg["uid"] and all(cap_eff >> bit & 1 for bit in (2, 6, 7))  # DAC_READ_SEARCH, SETGID/UID
if drop:
    # keep only CAP_DAC_READ_SEARCH (read the interpreter's files wherever they are) across the uid change
    libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    class Head(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Caps(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    caps = (Caps * 2)()
    caps[0].effective = caps[0].permitted = 1 << 2  # CAP_DAC_READ_SEARCH
    libc.capset(ctypes.byref(Head(0x20080522, 0)), caps)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
lim(resource.RLIMIT_NPROC, cfg["nproc"])
lim(resource.RLIMIT_CPU, cfg["cpu"])
lim(resource.RLIMIT_FSIZE, cfg["fsize"])
lim(resource.RLIMIT_NOFILE, 64)
lim(resource.RLIMIT_AS, cfg["mem"])
import socket
def _blocked(*a, **k):
    raise PermissionError("network access is disabled in the polyrl sandbox")
socket.socket = socket.create_connection = socket.socketpair = _blocked
out.write(f"{nonce} net {isolated} {int(bool(drop))}\n")
code, tests = cfg["code"], cfg["tests"]
del cfg
def msg(e):
    return json.dumps(type(e).__name__ + ": " + str(e)[:120])
if tests and isinstance(tests[0], dict):  # stdin/stdout cases: the code runs as __main__ once per case
    import io
    program = compile(code, "solution.py", "exec")
    for i, case in enumerate(tests):
        buf = io.BytesIO()
        sys.stdin = io.TextIOWrapper(io.BytesIO(case["stdin"].encode()))
        sys.stdout = io.TextIOWrapper(buf, write_through=True)
        try:
            try:
                exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
            sys.stdout.flush()
            got = buf.getvalue().decode(errors="replace")
            sys.stdout = sys.__stdout__
            if got.split() == case["stdout"].split():
                out.write(f"{nonce} test {i} 1\n")
            else:
                out.write(f"{nonce} test {i} 0 {json.dumps('wrong output: ' + got[:80])}\n")
        except BaseException as e:
            sys.stdout = sys.__stdout__
            out.write(f"{nonce} test {i} 0 {msg(e)}\n")
    out.write(f"{nonce} done\n")
    os._exit(0)
env = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(code, "solution.py", "exec"), env)
except BaseException as e:
    out.write(f"{nonce} code_error {json.dumps(type(e).__name__ + ': ' + str(e)[:200])}\n")
    os._exit(0)
for i, t in enumerate(tests):
    try:
        exec(compile(t, f"test_{i}.py", "exec"), env)
        out.write(f"{nonce} test {i} 1\n")
    except BaseException as e:
        out.write(f"{nonce} test {i} 0 {msg(e)}\n")
out.write(f"{nonce} done\n")
os._exit(0)
"""


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        state, uids = fields.get("State", "").split(), fields.get("Uid", "").split()
        if uids and int(uids[0]) == uid and state[:1] not in (["Z"], ["X"]):
            pids.append(int(entry))
    return pids


def _kill_all(proc: subprocess.Popen, uid: int) -> None:
    """SIGKILL the sandbox's process group and (as root) every process of its uid, until none is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid:
        for _ in range(50):  # a fork bomb may still be forking between two scans
            pids = _pids_of_uid(uid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _user_processes() -> int:
    try:
        return len(_pids_of_uid(os.getuid()))
    except OSError:
        return 256


def run_tests(
    code: str,
    tests: Sequence[str] | Sequence[dict[str, str]],
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_file_mb: int = 16,
    extra_processes: int = 16,
) -> SandboxResult:
    """Run ``code`` then each of ``tests`` in the sandbox (see the module docstring): snippets run after the code in
    its namespace, or ``{"stdin", "stdout"}`` cases each run the code as ``__main__`` (``example_tests``).
    ``timeout``: wall-clock seconds for the whole run (the CPU limit is the same, rounded up)."""
    tests = list(tests)
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    uid = UID_BASE + random.SystemRandom().randrange(100_000) if is_root else 0
    nonce = secrets.token_hex(8)
    tmp = tempfile.mkdtemp(prefix="polyrl-sandbox-")
    read_fd, write_fd = os.pipe()
    t0 = time.monotonic()
    result = SandboxResult(passed=0, total=len(tests))
    try:
        if uid:
            os.chown(tmp, uid, uid)
        cfg = {
            "fd": write_fd,
            "nonce": nonce,
            "uid": uid,
            "nproc": extra_processes if uid else _user_processes() + extra_processes,
            "cpu": int(timeout) + 1,
            "fsize": max_file_mb << 20,
            "mem": memory_mb << 20,
            "code": code,
            "tests": tests,
        }
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _HARNESS],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp,
            env=env,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
        os.close(write_fd)
        write_fd = -1
        try:
            proc.stdin.write((json.dumps(cfg) + "\n").encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        data, finished = _read(read_fd, t0 + timeout, nonce)
        result.timed_out = not finished
        _kill_all(proc, uid)
        if not finished:  # what the killed processes wrote last
            data += _read(read_fd, time.monotonic() + 1.0, nonce)[0]
        for ln in data.decode(errors="replace").splitlines():
            _parse_line(ln, nonce, result)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
        shutil.rmtree(tmp, ignore_errors=True)
    result.seconds = time.monotonic() - t0
    return result


def _read(fd: int, deadline: float, nonce: str) -> tuple[bytes, bool]:
    """What the sandbox writes to ``fd`` until it says it is done (or every writer is gone): ``(data, True)``; at
    ``deadline`` first: ``(data so far, False)``."""
    buf = bytearray()
    ends = (f"{nonce} done\n".encode(), f"{nonce} code_error ".encode())
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(buf), False
            if not sel.select(timeout=left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(buf), True
            buf += chunk
            if ends[0] in buf or (ends[1] in buf and buf.endswith(b"\n")):
                return bytes(buf), True


def _parse_line(line: str, nonce: str, result: SandboxResult) -> None:
    parts = line.split(" ", 3)
    if len(parts) < 2 or parts[0] != nonce:
        return
    if parts[1] == "net":
        flags = line.split()[2:]
        result.network_isolated = flags[:1] == ["1"]
        result.own_uid = flags[1:2] == ["1"]
    elif parts[1] == "code_error":
        result.code_error = json.loads(line.split(" ", 2)[2])
    elif parts[1] == "test" and len(parts) >= 3:
        idx, rest = parts[2], parts[3] if len(parts) > 3 else ""
        ok = rest.split(" ", 1)[0] == "1"
        if ok:
            result.passed += 1
        elif len(result.failures) < 3:
            result.failures.append(f"test {idx}: {json.loads(rest[2:]) if rest[2:] else 'failed'}")


__all__ = ["SandboxResult", "example_tests", "extract_code", "run_tests"]
