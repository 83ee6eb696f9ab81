"""Issue 29 (1): the ``code_exec`` reward and its sandbox, on real child processes: pass fractions, a hanging
solution (timeout, partial results kept), a fork bomb (RLIMIT_NPROC, nothing left running), a network attempt (a
real listening socket that must see no connection), a memory bomb (RLIMIT_AS), and the data fields it reads."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from polyrl.algorithms import rewards as R
from polyrl.algorithms.sandbox import UID_BASE, example_tests, extract_code, run_tests

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux rlimits and namespaces")

TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]


def row(tests=TESTS):
    return {"prompt": "write add", "answer": None, "metadata": {"tests": tests}}


def test_pass_fraction_of_correct_and_half_right_code():
    good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    half = "```python\ndef add(a, b):\n    return 3\n```"
    assert R.resolve("code_exec")(good, row()) == {"reward": 1.0, "code_timeout": 0.0, "code_error": 0.0}
    out = R.code_exec(half, row())
    assert out["reward"] == 0.5 and out["code_error"] == 0.0
    r = run_tests(extract_code(half), TESTS, timeout=5)
    assert (r.passed, r.total) == (1, 2) and r.failures == ["test 1: AssertionError: "]


def test_infinite_loop_times_out_and_keeps_the_results_before_it():
    code = "def add(a, b):\n    if a == 2:\n        while True:\n            pass\n    return a + b\n"
    t0 = time.monotonic()
    r = run_tests(code, TESTS, timeout=1.0)
    assert r.timed_out and (r.passed, r.total) == (1, 2) and r.fraction == 0.5
    assert time.monotonic() - t0 < 10
    top = run_tests("while True:\n    pass\n", TESTS, timeout=1.0)
    assert top.timed_out and top.passed == 0


def _sandbox_pids() -> list[int]:
    """Live processes under a sandbox uid (zombies waiting for init to reap them hold nothing)."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uid = int(fields["Uid"].split()[0])
        if UID_BASE <= uid < UID_BASE + 100_000 and fields["State"].split()[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def test_fork_bomb_is_contained_and_nothing_survives():
    # forks as often as it can, each child sleeps: the process limit must stop it far below 200
    counting = (
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\n"
    )
    r = run_tests(counting, ["assert n < 50, n"], timeout=5)
    if os.geteuid() != 0 or r.own_uid:  # RLIMIT_NPROC holds (as root: under the sandbox's own uid)
        assert (r.passed, r.timed_out) == (1, False), r
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_tests(bomb, TESTS, timeout=1.0)
    assert r.timed_out and r.passed == 0
    if os.geteuid() == 0:  # as root the sandbox runs under its own uid: every process of it must be gone
        assert _sandbox_pids() == []


def test_network_attempt_fails_and_reaches_nothing():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        # the socket module is blocked in the sandbox, whatever the kernel allows
        plain = run_tests(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", ["1"])
        with pytest.raises(socket.timeout):
            server.accept()
        # _socket (below it) gets past that guard: only the empty network namespace stops it
        raw = run_tests(
            f"import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\n", ["1"]
        )
        if raw.network_isolated:
            with pytest.raises(socket.timeout):
                server.accept()
    finally:
        server.close()
    assert plain.passed == 0 and "PermissionError: network access is disabled" in plain.code_error
    if raw.network_isolated:
        assert raw.passed == 0 and ("unreachable" in raw.code_error or "refused" in raw.code_error)


def test_memory_bomb_is_contained():
    r = run_tests("x = bytearray(4 * 1024**3)\ndef add(a, b):\n    return a + b\n", TESTS, timeout=5, memory_mb=256)
    assert r.passed == 0 and not r.timed_out and r.code_error.startswith("MemoryError")


def test_main_block_does_not_run_and_writes_stay_in_the_temp_dir():
    code = (
        "open('out.txt', 'w').write('x')\ndef add(a, b):\n    return a + b\nif __name__ == '__main__':\n    input()\n"
    )
    r = run_tests(code, [*TESTS, "import os\nassert os.path.exists('out.txt')"], timeout=5)
    assert (r.passed, r.total) == (3, 3)
    assert not os.path.exists("out.txt")


def test_fields_read_from_the_row():
    assert extract_code("no fence") == "no fence"
    assert extract_code("```\nA\n```\n```python\nB\n```\n```\nC\n```") == "B\n"
    assert extract_code("```\nplain\n```") == "plain\n"
    assert example_tests({"tests": ["a", "b"]}) == ["a", "b"]
    assert example_tests({"metadata": {"test_list": ["x"]}}) == ["x"]
    assert example_tests({"metadata": {"test": "def check(f):\n    assert f()\n", "entry_point": "g"}}) == [
        "def check(f):\n    assert f()\n\ncheck(g)\n"
    ]
    assert example_tests({"metadata": {"input_output": '{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}'}}) == [
        {"stdin": "1 2\n", "stdout": "3\n"}
    ]
    assert example_tests({"inputs": [["1", "2"]], "outputs": ["3"]}) == [{"stdin": "1\n2", "stdout": "3"}]
    with pytest.raises(ValueError, match="the same length"):
        example_tests({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="'tests' or 'test_list' list, a 'test' program, or 'input_output'"):
        example_tests({"metadata": {}})


def test_stdin_stdout_cases():
    cases = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5\n", "stdout": "10"}, {"stdin": "2 2", "stdout": "5"}]
    programs = {
        "input": "a, b = map(int, input().split())\nprint(a + b)\n",
        "buffer": "import sys\n\ndef main():\n    a, b = map(int, sys.stdin.buffer.read().split())\n"
        "    sys.stdout.write(str(a + b) + '\\n')\n    sys.exit(0)\n\nif __name__ == '__main__':\n    main()\n",
    }
    for name, code in programs.items():
        r = run_tests(code, cases, timeout=5)
        assert (r.passed, r.total) == (2, 3), (name, r)
        assert r.failures == ["test 2: wrong output: 4\n"]
    out = R.code_exec("```python\nprint(int(input()) * 2)\n```", {"metadata": {"inputs": ["4"], "outputs": ["8"]}})
    assert out["reward"] == 1.0


def test_code_exec_in_the_worker_pool_counts_a_row_without_tests():
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    with R.RewardPool("code_exec", workers=1, timeout=20) as pool:
        res = pool.score([good, "def add(a, b): return 0", good], [row(), row(), {"metadata": {}}])
    assert res.rewards == [1.0, 0.0, 0.0]
    assert res.failures["error"] == 1 and "has no tests" in res.messages[0]
    assert res.metrics()["reward/code_error"] == 0.0
