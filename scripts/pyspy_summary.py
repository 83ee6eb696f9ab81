"""Summarise a py-spy ``--threads -f raw`` recording: samples per thread, and the functions with the most samples
(self and inclusive) per thread. With ``--gil`` recordings only samples holding the GIL are kept, so a thread's share
is its share of the GIL. Usage: python scripts/pyspy_summary.py FILE.raw [--top N]"""

from __future__ import annotations

import argparse
import collections


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("raw", help="py-spy record -f raw output")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    threads: collections.Counter[str] = collections.Counter()
    own: collections.Counter[tuple[str, str]] = collections.Counter()
    inclusive: collections.Counter[tuple[str, str]] = collections.Counter()
    with open(args.raw) as f:
        for line in f:
            line = line.rstrip()
            if not line:
                continue
            stack, count = line.rsplit(" ", 1)
            n = int(count)
            frames = stack.split(";")
            thread = frames[0]
            threads[thread] += n
            own[(thread, frames[-1])] += n
            for frame in set(frames[1:]):
                inclusive[(thread, frame)] += n
    total = sum(threads.values()) or 1
    print(f"{total} samples")
    for thread, n in threads.most_common():
        print(f"{n:8d} {100 * n / total:5.1f}%  {thread}")
    for title, table in (("self", own), ("inclusive", inclusive)):
        print(f"--- {title}")
        for (thread, frame), n in table.most_common(args.top):
            print(f"{n:8d} {100 * n / total:5.1f}%  {thread[:28]:28s} {frame[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
