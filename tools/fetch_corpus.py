#!/usr/bin/env python3
"""Fetch and clean the English corpus the bundled model is trained on.

Source: Jane Austen's six completed novels (Emma, Mansfield Park, Northanger
Abbey, Persuasion, Pride and Prejudice, Sense and Sensibility), public-domain
Project Gutenberg texts as shipped by Debian's `r-cran-janeaustenr` package
(the R package is MIT licensed; the novels themselves are in the public
domain).  The package is fetched with `apt-get download`, so this needs only
Debian's package archive (run `apt-get update` once first) and no R: the R
lazy-load database it stores the books in is decoded here.

Usage:

    python3 tools/fetch_corpus.py                  # writes corpus/ at the repository root
    python3 tools/fetch_corpus.py --out /tmp/corpus
    python3 tools/fetch_corpus.py --deb r-cran-janeaustenr_1.0.0-1_all.deb

Output (about 4 MB): one cleaned UTF-8 file per novel, `<slug>.txt`, with one
paragraph per line block (paragraphs separated by a blank line, hard line wraps
joined, chapter headings and front matter dropped, `_italics_` markers removed,
`--` written as an em dash), and `SOURCE.json` recording the package, its
version, its SHA-256 and the licence.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import NoReturn

PACKAGE = "r-cran-janeaustenr"
DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
TITLES = {
    "emma": "Emma (1815)",
    "mansfieldpark": "Mansfield Park (1814)",
    "northangerabbey": "Northanger Abbey (1817)",
    "persuasion": "Persuasion (1817)",
    "prideprejudice": "Pride and Prejudice (1813)",
    "sensesensibility": "Sense and Sensibility (1811)",
}
LICENCE = (
    "The novels are in the public domain (Project Gutenberg texts). They are "
    "taken from Debian's r-cran-janeaustenr package, whose packaging and R code "
    "are MIT licensed (Copyright 2016-2017 Julia Silge)."
)


def fail(msg: str) -> NoReturn:
    print(f"fetch_corpus: error: {msg}", file=sys.stderr)
    sys.exit(1)


# -----------------------------------------------------------------------------
# R serialization (format 2/3, XDR), only the types a data package of character
# vectors uses.  See R Internals, "Serialization formats".
# -----------------------------------------------------------------------------

NILVALUE, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, REFSXP = (
    254,
    1,
    2,
    9,
    10,
    13,
    14,
    16,
    19,
    255,
)


class RObject:
    """A decoded R vector: its elements and its attributes (e.g. `names`)."""

    def __init__(self, values: list, attributes: dict):
        self.values = values
        self.attributes = attributes


class RReader:
    def __init__(self, data: bytes, where: str):
        self.data = data
        self.pos = 0
        self.refs: list = []
        self.where = where

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def read(self):
        if self.data[:2] != b"X\n":
            fail(f"{self.where}: not an R XDR serialization (starts with {self.data[:2]!r})")
        self.pos = 2
        version = self.int()
        self.int()  # R version that wrote it
        self.int()  # minimal R version to read it
        if version == 3:
            n = self.int()
            self.pos += n  # native encoding name
        return self.item()

    def item(self):
        flags = self.int()
        kind = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if kind == NILVALUE:
            return None
        if kind == REFSXP:
            return self.refs[(flags >> 8) - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            raw = self.data[self.pos : self.pos + n]
            self.pos += n
            return raw.decode("utf-8" if flags & (1 << 3) else "latin-1")
        if kind == LISTSXP:
            pairs = {}
            while kind == LISTSXP:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else None
                pairs[tag] = self.item()
                flags = self.int()
                kind = flags & 0xFF
                has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
            if kind != NILVALUE:
                fail(f"{self.where}: malformed pairlist (ends with type {kind})")
            return pairs
        if kind in (STRSXP, VECSXP):
            values = [self.item() for _ in range(self.int())]
        elif kind in (LGLSXP, INTSXP):
            n = self.int()
            values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == REALSXP:
            n = self.int()
            values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        else:
            fail(f"{self.where}: unsupported R object type {kind}")
        attributes = self.item() if has_attr else {}
        return RObject(values, attributes)


def read_lazyload_db(data_dir: Path) -> dict[str, list[str]]:
    """Decode an R lazy-load database (Rdata.rdx index + Rdata.rdb blobs)."""
    rdx, rdb = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    for p in (rdx, rdb):
        if not p.is_file():
            fail(f"{p}: missing from the package (has its layout changed?)")
    index = RReader(gzip.decompress(rdx.read_bytes()), str(rdx)).read()
    variables = index.values[0]
    names = variables.attributes.get("names")
    blob = rdb.read_bytes()
    books = {}
    for name, entry in zip(names.values, variables.values, strict=True):
        offset, length = entry.values
        chunk = blob[offset : offset + length]
        # Each entry: 4-byte big-endian uncompressed size, then a zlib stream.
        obj = RReader(zlib.decompress(chunk[4:]), f"{rdb}[{name}]").read()
        books[name] = ["" if line is None else line for line in obj.values]
    return books


# -----------------------------------------------------------------------------
# Cleaning
# -----------------------------------------------------------------------------

HEADING = re.compile(r"^(chapter|volume)\s+([0-9]+|[ivxlc]+)\.?$", re.IGNORECASE)
END_MARK = re.compile(r"^(the end|finis)\.?$", re.IGNORECASE)


def clean_book(lines: list[str]) -> list[str]:
    """Paragraphs of a novel: front matter and headings dropped, wraps joined."""
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    first_chapter = next((i for i, p in enumerate(paragraphs) if HEADING.match(p)), None)
    if first_chapter is None:
        fail("no chapter heading found: the package's text is not what this script expects")
    out = []
    for p in paragraphs[first_chapter:]:
        if HEADING.match(p) or END_MARK.match(p):
            continue
        p = p.replace("_", "").replace("--", "\u2014")
        p = re.sub(r"\s+", " ", p).strip()
        if p:
            out.append(p)
    return out


def download(workdir: Path) -> Path:
    try:
        subprocess.run(["apt-get", "download", PACKAGE], cwd=workdir, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        fail("apt-get not found: run this on a Debian/Ubuntu machine, or pass --deb with the downloaded package")
    except subprocess.CalledProcessError as e:
        fail(
            f"`apt-get download {PACKAGE}` failed:\n{e.stderr.strip()}\n"
            "Run `apt-get update` first, or download the .deb elsewhere and pass --deb PATH."
        )
    debs = sorted(workdir.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        fail(f"apt-get download {PACKAGE} wrote no .deb into {workdir}")
    return debs[-1]


def main() -> None:
    repo_root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=repo_root / "corpus", help="output folder (default: corpus/)")
    ap.add_argument("--deb", type=Path, help=f"an already downloaded {PACKAGE} .deb")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        deb = args.deb if args.deb else download(tmp)
        if not deb.is_file():
            fail(f"{deb}: no such file")
        sha256 = hashlib.sha256(deb.read_bytes()).hexdigest()
        try:
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "x")], check=True, capture_output=True, text=True)
            version = subprocess.run(
                ["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True, text=True
            ).stdout.strip()
        except FileNotFoundError:
            fail("dpkg-deb not found: run this on a Debian/Ubuntu machine")
        except subprocess.CalledProcessError as e:
            fail(f"{deb}: dpkg-deb could not read it: {e.stderr.strip()}")
        books = read_lazyload_db(tmp / "x" / DATA_DIR)

    missing = set(TITLES) - set(books)
    if missing:
        fail(f"{deb}: the package lacks {sorted(missing)}; found {sorted(books)}")
    args.out.mkdir(parents=True, exist_ok=True)
    files = {}
    for slug in sorted(TITLES):
        text = "\n\n".join(clean_book(books[slug])) + "\n"
        path = args.out / f"{slug}.txt"
        path.write_text(text, encoding="utf-8")
        files[f"{slug}.txt"] = {"title": TITLES[slug], "bytes": len(text.encode("utf-8"))}
        print(f"{path}: {TITLES[slug]}, {len(text.encode('utf-8')):,} bytes")
    source = {
        "package": PACKAGE,
        "version": version,
        "deb_sha256": sha256,
        "origin": "Debian archive (apt-get download)",
        "licence": LICENCE,
        "cleaning": "front matter and chapter/volume headings dropped, hard wraps joined, "
        "_italics_ markers removed, '--' written as U+2014, paragraphs separated by a blank line",
        "files": files,
    }
    (args.out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    print(
        f"{args.out / 'SOURCE.json'}: {sum(f['bytes'] for f in files.values()):,} bytes of text in {len(files)} files"
    )


if __name__ == "__main__":
    main()
