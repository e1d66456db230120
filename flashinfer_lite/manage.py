"""`flashinfer-lite cache [list | rm NAME... | rm --all]`: what the user cache holds, and removing it (as mlx-lm's
`manage`). Converted models are keyed by their source's content, so an entry whose source is gone or changed stays
until removed here."""
from __future__ import annotations

import sys

from storage.cache import cache_dir, entries, remove


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"



def add_arguments(p) -> None:
    p.add_argument("action", nargs="?", choices=("list", "rm"), default="list")
    p.add_argument("names", nargs="*", metavar="NAME", help="entries to remove (names as `cache list` prints them)")
    p.add_argument("--all", action="store_true", help="with rm: remove every entry")


def run(args) -> int:
    if args.action == "list":
        if args.names or args.all:
            print("error: `cache list` takes no names (did you mean `cache rm`?)", file=sys.stderr)
            return 2
        rows = entries()
        print(f"cache: {cache_dir()}")
        for e in rows:
            src = ""
            if e["kind"] == "flashdir":
                src = f"  from {e['source']}" + ("" if e["source_exists"] else " (gone)") if e["source"] else \
                      "  (source unknown)"
            elif e["kind"] == "leftover":
                src = f"  (left by process {e['pid']}, which was killed; `cache rm` removes it)"
            elif e["kind"] == "writing":
                src = f"  (being written by process {e['pid']})"
            print(f"  {mib(e['bytes']):>10}  {e['kind']:<8}  {e['name']}{src}")
        print(f"  {mib(sum(e['bytes'] for e in rows)):>10}  total, {len(rows)} entries")
        return 0
    if not args.names and not args.all:
        print("error: `cache rm` needs NAME... or --all", file=sys.stderr)
        return 2
    rows = entries()
    names = [e["name"] for e in rows if e["kind"] != "writing"] if args.all else args.names
    freed = sum(remove(n) for n in names)
    busy = sum(e["kind"] == "writing" for e in rows) if args.all else 0
    print(f"removed {len(names)} entries, {mib(freed)} freed" +
          (f" ({busy} being written by a running conversion kept)" if busy else ""))
    return 0
