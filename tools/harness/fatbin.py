"""A CUDA extension's device code cut to the GPUs a bundle is for (tools/gpu_bundle.sh): the lent GPU machine
receives 64 MiB in all, and comfy-kitchen's CUDA backend alone holds 172 MB of device code for six architectures
(sm_75 to sm_120; 21 MB with xz). Each fat binary in the library's .nv_fatbin section keeps its header where it
is, lists only the machine code of the architectures kept (and every PTX entry, the driver's fallback, unless
--no-ptx), and the bytes freed are zeros, so nothing else in the file moves and xz packs them into nothing.

    python -m tools.harness.fatbin LIBRARY.so --keep 90 [--no-ptx]
"""
from __future__ import annotations

import argparse
import struct
import subprocess
from pathlib import Path

MAGIC = 0xBA55ED50
HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
ENTRY = struct.Struct("<HHIQ")  # kind (1 PTX, 2 ELF), version, entry header size, payload size
ARCH_OFFSET = 28  # the entry's architecture (sm_XY as XY) within its header
PTX, ELF = 1, 2


def fatbin_section(path: Path) -> tuple[int, int]:
    """(file offset, size) of `path`'s .nv_fatbin section, from readelf."""
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.replace("[ ", "[").split()
        if ".nv_fatbin" in parts:
            at = parts.index(".nv_fatbin")
            return int(parts[at + 3], 16), int(parts[at + 4], 16)
    raise ValueError(f"{path} has no .nv_fatbin section")


def entries(blob: bytes, start: int) -> tuple[int, list[tuple[int, int, int, int]]]:
    """The fat binary at `start`: its end, and each entry as (offset, length, kind, arch)."""
    _, _, header_size, size = HEADER.unpack_from(blob, start)
    found, at, end = [], start + header_size, start + header_size + size
    while at < end:
        kind, _, entry_header, payload = ENTRY.unpack_from(blob, at)
        arch = struct.unpack_from("<I", blob, at + ARCH_OFFSET)[0]
        found.append((at, entry_header + payload, kind, arch))
        at += entry_header + payload
    return end, found


def trim(data: bytearray, offset: int, size: int, keep: set[int], ptx: bool = True) -> dict:
    """Cut every fat binary in data[offset:offset+size] to the ELF entries of `keep` (and the PTX ones, unless
    not `ptx`), in place."""
    at, stats = offset, {"binaries": 0, "kept": 0, "dropped": 0, "bytes_freed": 0, "without_kept_arch": 0}
    while at + HEADER.size <= offset + size:
        magic, version, header_size, _ = HEADER.unpack_from(data, at)
        if magic != MAGIC:
            at += 8  # fat binaries are 8-byte aligned, zeros between them
            continue
        end, found = entries(data, at)
        kept = [e for e in found if (ptx and e[2] == PTX) or (e[2] == ELF and e[3] in keep)]
        stats["binaries"] += 1
        stats["without_kept_arch"] += not any(e[2] == ELF and e[3] in keep for e in found)
        body = b"".join(bytes(data[o:o + n]) for o, n, _, _ in kept)
        first = at + header_size
        data[first:end] = body + bytes(end - first - len(body))
        HEADER.pack_into(data, at, magic, version, header_size, len(body))
        stats["kept"] += len(kept)
        stats["dropped"] += len(found) - len(kept)
        stats["bytes_freed"] += end - first - len(body)
        at = end
    return stats


def architectures(path: Path) -> dict[tuple[int, int], int]:
    """(kind, arch) -> bytes of the library's device code: what a trim left."""
    data = path.read_bytes()
    offset, size = fatbin_section(path)
    at, sizes = offset, {}
    while at + HEADER.size <= offset + size:
        if HEADER.unpack_from(data, at)[0] != MAGIC:
            at += 8
            continue
        at, found = entries(data, at)
        for _, n, kind, arch in found:
            sizes[kind, arch] = sizes.get((kind, arch), 0) + n
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", type=Path)
    parser.add_argument("--keep", default="90", help="comma-separated architectures (90: H100 and H200)")
    parser.add_argument("--no-ptx", action="store_true", help="drop the PTX too (the kept machine code serves)")
    args = parser.parse_args()
    keep = {int(a) for a in args.keep.split(",")}
    data = bytearray(args.library.read_bytes())
    stats = trim(data, *fatbin_section(args.library), keep, ptx=not args.no_ptx)
    if stats["without_kept_arch"]:
        raise SystemExit(f"{args.library}: {stats['without_kept_arch']} fat binaries have no machine code for "
                         f"{sorted(keep)}; left as it was")
    args.library.write_bytes(bytes(data))
    left = {f"{'ptx' if kind == PTX else 'sm'}_{arch}": n for (kind, arch), n in sorted(architectures(args.library).items())}
    print(f"[fatbin] {args.library.name}: {stats}; left {left}")


if __name__ == "__main__":
    main()
