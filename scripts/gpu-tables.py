#!/usr/bin/env python3
"""Markdown tables from the `pagedkv bench gpu` logs of a device call.

    python3 scripts/gpu-tables.py logs.tar.gz [more logs, folders or .log files]

Reads every `decode ...` and `prefill ...` table the bench printed (a call's bench-*.log and
sweep-*.log stages; not its ncu-* stages, whose bench ran under the profiler: those times are
not figures) and prints, in the units BENCHMARKS.md uses:
  * decode: one row per point, a graph-time column per table read (its log's name, mode and
    launch flags), SDPA's graph time (the first table's that has it), and each column over
    SDPA (its own process's where it ran the peer; the issue's <= 1.1x);
  * prefill, per head dim: SDPA's graph time and which SDPA it was (the peer's note: the
    fastest of the ways it timed, and its CUDA kernels), then each tiling's time and its share
    of SDPA's TFLOP/s (>= 70%), and which tiling Auto ran;
  * the fastest decode column per point, where several were read (a split sweep).
A point whose output the bench found wrong (`CHECK FAILED`) says so in its cell and is never
the fastest.
Nothing is computed that the bench did not time; a skipped cell says `skip`. Where two columns
would carry the same label (the same stage of two calls, or two tables of one tiling), each
says which call and stage it came from.
"""
import os
import re
import sys
import tarfile

DECODE_HEAD = re.compile(r"^decode (\w+) d(\d+) bs(\d+) mode (.+?)((?:, [^;]+)?); times per call")
PREFILL_HEAD = re.compile(r"^prefill (\w+) d(\d+) bs(\d+) tiling (\w+)(.*?), one sequence")
AUTO_RAN = re.compile(r"^\s+\(Auto(?: ran (\w+)|: the f32 kernel)\)")
# `CHECK FAILED decode POINT: ...` / `CHECK FAILED prefill POINT TILING: ...`, printed after the
# row of a point whose output differed from the CPU oracle.
CHECK_FAILED = re.compile(r"^CHECK FAILED (decode|prefill) (\S+?):? ")
# `peer note: POINT: NOTE`, printed after a process's tables.
PEER_NOTE = re.compile(r"^peer note: (\S+): (.*)$")
NUM = re.compile(r"^-?\d+(\.\d+)?%?$")
# A grid point, `Q:KV/BATCHxCTX` or `Q:KV/CHUNK+CACHED` (the header's `heads/BxCTX` is not).
POINT = re.compile(r"^\d+:\d+/\d+[x+]\d+$")


def profiled(name):
    """Whether a stage's log is an ncu profile (its bench's times are the profiler's)."""
    return name.startswith("ncu-")


def texts(paths):
    """(origin, name, text) of every .log under the given archives, folders and files (the
    ncu-* profiles of archives and folders left out), a call's logs in the order its stages
    ended (their modification times); origin is the path given (archive, folder or file)."""
    for path in paths:
        origin = path
        if path.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path) as tar:
                for m in sorted(tar.getmembers(), key=lambda m: (m.mtime, m.name)):
                    name = os.path.basename(m.name)[:-4]
                    if m.isfile() and m.name.endswith(".log") and not profiled(name):
                        data = tar.extractfile(m).read().decode("utf-8", "replace")
                        yield origin, name, data
        elif os.path.isdir(path):
            def ended(f):
                return (os.stat(os.path.join(path, f)).st_mtime, f)
            for f in sorted(os.listdir(path), key=ended):
                if f.endswith(".log") and not profiled(f[:-4]):
                    with open(os.path.join(path, f), encoding="utf-8", errors="replace") as h:
                        yield origin, f[:-4], h.read()
        else:
            with open(path, encoding="utf-8", errors="replace") as h:
                yield origin, os.path.basename(path).rsplit(".", 1)[0], h.read()


def cells(line):
    """The row's point and its cells: ours (graph us, or None when skipped), the peer's graph
    us (or None), or None when the line is not a table row."""
    parts = [p.strip() for p in line.split("|")]
    if len(parts) != 4:
        return None
    head = parts[0].split()
    if len(head) not in (1, 2) or not POINT.match(head[0]):
        return None
    ours = parts[1].split()
    peer = parts[2].split()
    our_t = float(ours[0]) if ours and NUM.match(ours[0]) else None
    peer_t = float(peer[0]) if peer and NUM.match(peer[0]) else None
    return head[0], our_t, peer_t


def peer_way(note):
    """Which SDPA a peer note says ran: the fastest way (where it timed several) and the CUDA
    kernels of one call, `; `-joined."""
    way, kernels = None, None
    for part in note.split("; "):
        if part.startswith("fastest of ") and ": " in part:
            way = part.split(": ", 1)[1].split(" (others:")[0]
        elif part.startswith("kernels: "):
            kernels = part[len("kernels: "):]
        elif ": K/V expanded" in part:
            w = part.split(": K/V expanded")[0]
            if way in (None, w):
                way = w + " (K/V expanded)"
    return "; ".join(x for x in (way, kernels) if x).replace("|", "/") or None


def parse(paths):
    """Tables read: a list of dicts {kind, dim, label, rows: {point: (ours, peer)}, failed:
    {points whose check failed}, auto, notes: {point: the peer's way}} (notes shared by the
    tables of one log)."""
    tables = []
    for origin, name, text in texts(paths):
        cur = None
        last_point = None
        notes = {}
        for line in text.splitlines():
            m = PEER_NOTE.match(line)
            if m:
                way = peer_way(m.group(2))
                if way:
                    notes[m.group(1)] = way
                continue
            m = DECODE_HEAD.match(line)
            if m:
                mode, flags = m.group(4), m.group(5).strip(", ")
                label = f"{name} {mode}" + (f" ({flags})" if flags else "")
                cur = {"kind": "decode", "dim": int(m.group(2)), "label": label, "rows": {},
                       "failed": set(), "notes": notes, "log": name, "origin": origin}
                tables.append(cur)
                continue
            m = PREFILL_HEAD.match(line)
            if m:
                flags = m.group(5).strip(", ")
                label = m.group(4) + (f" ({flags})" if flags else "")
                cur = {"kind": "prefill", "dim": int(m.group(2)), "label": label, "rows": {},
                       "failed": set(), "auto": {}, "log": name, "origin": origin,
                       "notes": notes}
                tables.append(cur)
                continue
            if cur is None:
                continue
            m = CHECK_FAILED.match(line)
            if m and m.group(1) == cur["kind"]:
                cur["failed"].add(m.group(2))
                continue
            m = AUTO_RAN.match(line)
            if m and cur["kind"] == "prefill" and last_point:
                cur["auto"][last_point] = m.group(1) or "f32"
                continue
            row = cells(line)
            if row:
                point, ours, peer = row
                cur["rows"][point] = (ours, peer)
                last_point = point
    tables = [t for t in tables if t["rows"]]
    unique_labels(tables)
    return tables


def unique_labels(tables):
    """Columns of one table (kind and head dim) whose labels repeat get their stage's log name,
    then, where that still repeats (the same stage of two calls), the call's archive or folder,
    then a running number."""
    def repeated(group):
        seen = {}
        for t in group:
            seen[t["label"]] = seen.get(t["label"], 0) + 1
        return [t for t in group if seen[t["label"]] > 1]
    groups = {}
    for t in tables:
        groups.setdefault((t["kind"], t["dim"]), []).append(t)
    for group in groups.values():
        for t in repeated(group):
            if not t["label"].startswith(t["log"] + " "):
                t["label"] = f"{t['log']} {t['label']}"
        for t in repeated(group):
            t["label"] = f"{t['origin']}: {t['label']}"
        count = {}
        for t in repeated(group):
            count[t["label"]] = count.get(t["label"], 0) + 1
            t["label"] = f"{t['label']} #{count[t['label']]}"


def fmt(x):
    return "skip" if x is None else f"{x:.1f}"


def by_dim(tables, kind):
    """Per head dim of the `kind` tables: its tables (the columns), their points in first-seen
    order, per point the peer's time of the first table that ran it, and that run's way."""
    of_kind = [t for t in tables if t["kind"] == kind]
    for dim in sorted({t["dim"] for t in of_kind}):
        cols = [t for t in of_kind if t["dim"] == dim]
        points = list(dict.fromkeys(p for t in cols for p in t["rows"]))
        peer, way = {}, {}
        for t in cols:
            for p, (_, q) in t["rows"].items():
                if q is not None and p not in peer:
                    peer[p] = q
                    way[p] = t["notes"].get(p, "-")
        yield dim, cols, points, peer, way


def point_cells(cols, p, peer, against):
    """A point's cell per column: its time, and `against(ours, peer)` where a peer time is at
    hand (the column's own process's first)."""
    out = []
    for t in cols:
        ours, own_peer = t["rows"].get(p, (None, None))
        q = own_peer if own_peer is not None else peer.get(p)
        cell = fmt(ours)
        if ours is not None and q is not None:
            cell += f" ({against(ours, q)})"
        if p in t["failed"]:
            cell += " CHECK FAILED"
        out.append(cell)
    return out


def table_head(head):
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))


def decode_tables(tables):
    for dim, cols, points, peer, _ in by_dim(tables, "decode"):
        print(f"\n**Decode d{dim}** (graph us; x: over SDPA)\n")
        table_head(["point"] + [t["label"] for t in cols] + ["SDPA"]
                   + (["fastest"] if len(cols) > 1 else []))
        for p in points:
            row = [p] + point_cells(cols, p, peer, lambda o, q: f"{o / q:.2f}x") + [fmt(peer.get(p))]
            if len(cols) > 1:
                timed = [(t["rows"][p][0], t["label"]) for t in cols
                         if p in t["rows"] and t["rows"][p][0] is not None
                         and p not in t["failed"]]
                row.append(min(timed)[1] if timed else "-")
            print("| " + " | ".join(row) + " |")


def prefill_tables(tables):
    for dim, cols, points, peer, way in by_dim(tables, "prefill"):
        auto = {}
        for t in cols:
            auto.update(t["auto"])
        print(f"\n**Prefill d{dim}** (graph us, % of SDPA's TFLOP/s)\n")
        table_head(["point", "SDPA us", "SDPA ran"] + [t["label"] for t in cols] + ["Auto ran"])
        for p in points:
            row = [p, fmt(peer.get(p)), way.get(p, "-")] + point_cells(cols, p, peer, lambda o, q: f"{100 * q / o:.1f}%")
            print("| " + " | ".join(row + [auto.get(p, "-")]) + " |")


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    tables = parse(argv[1:])
    if not tables:
        print("no bench tables found", file=sys.stderr)
        return 1
    decode_tables(tables)
    prefill_tables(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
