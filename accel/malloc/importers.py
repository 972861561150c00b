"""Which mapped libraries could change glibc's malloc behind the pack's back: those importing `mallopt` (which
freezes the thresholds) or `malloc_trim` (which gives free pages back, so they fault again).

Each library's ELF section headers and its .dynsym/.dynstr are read, nothing more (libtorch_cuda is over a
gigabyte); an imported symbol is one with no section (SHN_UNDEF). 64-bit little-endian ELF only; anything else
is skipped.
"""
from __future__ import annotations

import struct

WATCHED = frozenset({b"mallopt", b"__libc_mallopt", b"malloc_trim"})
SHT_DYNSYM = 11
ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
SECTION = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, align, entsize
SYMBOL = struct.Struct("<IBBHQQ")  # name, info, other, shndx, value, size


def imported_symbols(path: str, wanted=WATCHED) -> set[bytes]:
    """The names in `wanted` that the ELF file at `path` imports; empty for what is not 64-bit LE ELF."""
    with open(path, "rb") as f:
        header = f.read(ELF_HEADER.size)
        if len(header) < ELF_HEADER.size or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return set()
        fields = ELF_HEADER.unpack(header)
        section_offset, entry_size, count = fields[6], fields[11], fields[12]
        if entry_size != SECTION.size or not count:
            return set()
        f.seek(section_offset)
        table = f.read(entry_size * count)
        sections = [SECTION.unpack_from(table, i * entry_size) for i in range(len(table) // entry_size)]
        found = set()
        for section in sections:
            if section[1] != SHT_DYNSYM or section[6] >= len(sections):
                continue
            f.seek(section[4])
            symbols = f.read(section[5])
            strings_section = sections[section[6]]
            f.seek(strings_section[4])
            strings = f.read(strings_section[5])
            for offset in range(0, len(symbols) - SYMBOL.size + 1, SYMBOL.size):
                name, _, _, shndx, _, _ = SYMBOL.unpack_from(symbols, offset)
                if shndx == 0 and name:
                    end = strings.find(b"\0", name)
                    symbol = strings[name:end if end >= 0 else None]
                    if symbol in wanted:
                        found.add(symbol)
        return found


def mapped_libraries(pid: int | str = "self") -> list[str]:
    paths = []
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/") and ".so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def malloc_importers(pid: int | str = "self") -> dict[str, list[str]]:
    """{library path: ["mallopt", "malloc_trim"]} for each library mapped into pid that imports one of them."""
    found = {}
    for path in mapped_libraries(pid):
        try:
            symbols = imported_symbols(path)
        except (OSError, ValueError, struct.error):
            continue
        if symbols:
            found[path] = sorted("mallopt" if s == b"__libc_mallopt" else s.decode() for s in symbols)
    return found
