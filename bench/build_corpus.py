"""Build a larger offline English corpus for the A/B runs from text a package registry ships.

    python bench/build_corpus.py --out runs/data/linux-docs-en.parquet          # apt-get download + extract
    python bench/build_corpus.py --package linux-doc-6.12=6.12.117-1~deb12u1 --out ...   # one version, pinned
    python bench/build_corpus.py --deb linux-doc-6.12_*.deb --out corpus.parquet     # a .deb fetched before
    python train_accelerate.py --dataset runs/data/linux-docs-en.parquet ...

The source is Debian's `linux-doc-6.12` package (about 40 MB; the Linux kernel's documentation, GPL-2.0 for
most pages, some under GFDL-1.1 or CC-BY-4.0, as each page's SPDX line says and the `license` column keeps):
its `html/_sources/**/*.txt` files are the reStructuredText sources of every page. Built from
6.12.117-1~deb12u1: 2,590 pages kept of 3,604, 22.2M characters, 7.07M GPT-2 tokens, an 11 MB parquet, written by
many authors. Technical text, like the Python documentation the
smoke preset reads, but a different body of it, several times larger than the shared Wikipedia summaries.
The translations (`translations/`) are left out, and so are files that are mostly tables, code or register
maps (less than `--min-letter-share` letters) or shorter than `--min-chars`.

Each page becomes one document (column `text`, as the trainer reads by default; `id` is the page's path,
`license` its SPDX identifier when it has one). Markup is reduced to its words: section underlines, comments,
directives, substitutions and `:role:` syntax go; code blocks stay (they are part of the page). The rows are
in path order, so `--val-every-doc N` holds out the same pages every time.

Nothing here is committed: the corpus is built where it is used. `apt-get download` needs Debian's package
lists (`apt-get update` once); no root is needed for it. Python reads the .deb itself (ar + tar), so
`dpkg-deb` is not needed either.

Which corpus a run read: beside the parquet, `<name>.parquet.source` (JSON, under a suffix the trainer does not
read as data, so that --dataset DIR still takes the folder) records the package and version it was built from (the
.deb's own control file), the .deb's and the parquet's sha256 and the counts printed. Debian's mirror
serves the current version of the package only, so a later build may differ from an earlier one: the quality
runs of 2026-11-29 to 2026-12-01 (bench/QUALITY.md) read the corpus of 6.12.117-1~deb12u1 (parquet sha256
1255dc35b68a21d8...); 6.12.118-1~deb12u1 (b5c2403dcb462c4a..., the mirror's on 2026-12-02) changes two training
pages (filesystems/fsverity.rst, overlayfs.rst) and none of the held-out rows, so a run's training stream is the
same up to the first row holding one of them (seed 0 of the smoke A/B: step 694 of 900). Pin the version with
`--package NAME=VERSION` while the mirror still serves it (`apt-cache policy NAME` lists those it does), or keep
the .deb and pass --deb. The trainer records each local data file's sha256 in its run.json (data_files, up to 2 GiB
of data in all; sizes only above).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

DEFAULT_PACKAGE = "linux-doc-6.12"
SOURCES_DIR = "html/_sources/"  # inside /usr/share/doc/<package>/

_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+.:_])\1{2,}\s*$")  # a section title's line of one repeated mark
_ROLE = re.compile(r":[a-zA-Z:+-]+:`([^`<]*?)\s*(?:<[^`>]*>)?`")  # :ref:`text <target>` -> text
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`_+")  # `text <url>`_ -> text
_LITERAL = re.compile(r"``([^`]+)``")
_SPDX = re.compile(r"SPDX-License-Identifier:\s*([^\s*]+(?:\s+(?:OR|AND|WITH)\s+[^\s*]+)*)")


def read_deb_members(deb: Path, blob: bytes, wanted, archive: str = "data.tar") -> dict[str, bytes]:
    """The files of a .deb (its bytes `blob`; `deb` names it in errors) whose path `wanted(path)` accepts: a .deb
    is an `ar` archive whose data.tar.* member holds the files (xz, gz, zst-less bz2 or plain tar), and its
    control.tar.* member the package's control file (archive="control.tar")."""
    if blob[:8] != b"!<arch>\n":
        raise ValueError(f"--deb {deb}: not a Debian package (no ar header); pass a .deb file.")
    offset, data = 8, None
    while offset + 60 <= len(blob):
        header = blob[offset : offset + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        if name.startswith(archive):
            data = (name, blob[offset + 60 : offset + 60 + size])
            break
        offset += 60 + size + (size % 2)  # members are 2-byte aligned
    if data is None:
        raise ValueError(f"--deb {deb}: no {archive} member in it.")
    if data[0].endswith(".zst"):
        raise ValueError(f"--deb {deb}: its files are zstd-compressed, which Python's tarfile cannot read; extract it "
                         "with `dpkg-deb -x` and pass --from-dir.")  # fmt: skip
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data[1]), mode="r:*") as tar:
        for member in tar:
            path = member.name.removeprefix("./")
            if member.isfile() and wanted(path):
                out[path] = tar.extractfile(member).read()
    return out


def read_deb(deb: Path) -> tuple[dict[str, str], dict]:
    """A linux-doc .deb's pages ({path under html/_sources: text}) and where they came from: {"package", "version"
    (from the .deb's control file; None where it has none), "deb_sha256"}. Reads the file once (it is ~30 MB)."""
    blob = deb.read_bytes()
    members = read_deb_members(deb, blob, lambda p: SOURCES_DIR in p and p.endswith(".txt"))
    pages = {p.split(SOURCES_DIR, 1)[1]: b.decode("utf-8", errors="replace") for p, b in members.items()}
    fields = {}
    try:
        control = read_deb_members(deb, blob, lambda p: p == "control", archive="control.tar").get("control", b"")
        fields = dict(re.findall(r"^(Package|Version):\s*(\S+)", control.decode(errors="replace"), flags=re.M))
    except (ValueError, tarfile.TarError):
        pass
    source = {"package": fields.get("Package"), "version": fields.get("Version"),
              "deb_sha256": hashlib.sha256(blob).hexdigest()}  # fmt: skip
    return pages, source


def page_files_from_dir(root: Path) -> dict[str, str]:
    """An extracted package (`dpkg-deb -x`) or its html/_sources directory."""
    candidates = [root] + sorted(root.glob(f"usr/share/doc/*/{SOURCES_DIR}"))
    sources = next((c for c in candidates[::-1] if c.is_dir() and any(c.rglob("*.txt"))), None)
    if sources is None:
        raise FileNotFoundError(f"--from-dir {root}: no {SOURCES_DIR}**/*.txt files under it.")
    return {str(p.relative_to(sources)): p.read_text(encoding="utf-8", errors="replace")
            for p in sorted(sources.rglob("*.txt"))}  # fmt: skip


def download(package: str, where: Path) -> Path:
    """`apt-get download PACKAGE` (NAME or NAME=VERSION) into `where`; the .deb's path."""
    proc = subprocess.run(["apt-get", "download", package], cwd=where, capture_output=True, text=True)
    name, _, version = package.partition("=")
    debs = sorted(where.glob(f"{name}_*.deb"))
    if proc.returncode != 0 or not debs:
        if version and "Version" in proc.stderr and "was not found" in proc.stderr:
            raise RuntimeError(f"apt-get download {package}: the mirror does not serve version {version} "
                               f"({proc.stderr.strip()[-200:]}). `apt-cache policy {name}` lists the versions it "
                               "does; or fetch that .deb elsewhere and pass --deb FILE.")  # fmt: skip
        raise RuntimeError(f"apt-get download {package} failed ({proc.stderr.strip()[-300:]}); run `apt-get update` "
                           "first, or fetch the .deb elsewhere and pass --deb FILE.")  # fmt: skip
    return debs[-1]


def plain_text(rst: str) -> tuple[str, str | None]:
    """reStructuredText -> its words (see the module's docstring), and the SPDX license if the page states one."""
    spdx = _SPDX.search(rst)
    lines, in_comment = [], False
    for line in rst.splitlines():
        stripped = line.strip()
        if in_comment:  # a comment's indented continuation
            if stripped and not line[:1].isspace():
                in_comment = False
            else:
                continue
        if _UNDERLINE.match(line):
            continue
        if stripped.startswith(".. "):
            # a directive keeps its argument when it is text (".. note:: Text"), comments and targets go
            directive = re.match(r"\.\.\s+[\w:-]+::\s*(.*)", stripped)
            if directive and directive.group(1) and not directive.group(1).startswith((":", "|")):
                lines.append(directive.group(1))
            elif not directive:
                in_comment = True
            continue
        if re.match(r"\s*:[\w -]+:(\s|$)", line) and not _ROLE.search(line):  # a directive's option line
            continue
        line = _LINK.sub(r"\1", _ROLE.sub(r"\1", _LITERAL.sub(r"\1", line)))
        lines.append(line.rstrip())
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return text, spdx.group(1) if spdx else None


def build(pages: dict[str, str], min_chars: int, min_letter_share: float) -> list[dict]:
    rows = []
    for path in sorted(pages):
        if PurePosixPath(path).parts[0] == "translations":
            continue
        text, license_id = plain_text(pages[path])
        letters = sum(ch.isalpha() or ch.isspace() for ch in text)
        if len(text) < min_chars or letters < min_letter_share * len(text):
            continue
        rows.append({"text": text, "id": path.removesuffix(".txt"), "license": license_id or "GPL-2.0 (package)"})
    return rows


def write_parquet(rows: list[dict], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench/build_corpus.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the parquet file to write (column text)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--package", default=DEFAULT_PACKAGE,
                        help="the Debian package to apt-get download: NAME, or NAME=VERSION for one version")
    source.add_argument("--deb", type=Path, help="a .deb file downloaded before")
    source.add_argument("--from-dir", type=Path, help="an extracted package (dpkg-deb -x) or its html/_sources")
    p.add_argument("--min-chars", type=int, default=500, help="drop pages shorter than this (after markup removal)")
    p.add_argument("--min-letter-share", type=float, default=0.75,
                   help="drop pages with fewer letters and spaces than this share (tables, register maps)")
    p.add_argument("--tokenizer", default=None, help="also count the corpus's tokens with this tokenizer")
    args = p.parse_args(argv)
    if args.from_dir is not None:
        pages = page_files_from_dir(args.from_dir)
        source = {"from_dir": str(args.from_dir)}
    elif args.deb is not None:
        if not args.deb.is_file():
            raise FileNotFoundError(f"--deb {args.deb}: no such file.")
        pages, source = read_deb(args.deb)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            deb = download(args.package, Path(tmp))
            pages, source = read_deb(deb)
    if not pages:
        raise ValueError(f"no {SOURCES_DIR}**/*.txt pages found in the package; is it a linux-doc package?")
    rows = build(pages, args.min_chars, args.min_letter_share)
    if not rows:
        raise ValueError(f"no page passed --min-chars {args.min_chars} and --min-letter-share {args.min_letter_share}.")
    write_parquet(rows, args.out)
    stats = {"documents": len(rows), "pages_read": len(pages), "chars": sum(len(r["text"]) for r in rows)}
    if args.tokenizer:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from nsa_train.data import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        stats["tokens"] = sum(len(ids) for ids in tokenizer([r["text"] for r in rows], verbose=False).input_ids)
    record = {**source, "parquet_sha256": hashlib.sha256(args.out.read_bytes()).hexdigest(), **stats,
              "min_chars": args.min_chars, "min_letter_share": args.min_letter_share}
    source_file = args.out.with_name(args.out.name + ".source")  # (.json would be read as data: --dataset DIR)
    source_file.write_text(json.dumps(record, indent=2) + "\n")
    built_from = f" from {source['package']} {source['version']}" if source.get("version") else ""
    print(f"wrote {args.out}{built_from}: " + ", ".join(f"{k} {v:,}" for k, v in stats.items())
          + f"; sha256 {record['parquet_sha256'][:16]}..., recorded in {source_file}")
    return {**stats, "source": record}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nsa_train.long_context import run_command

    run_command(main)
