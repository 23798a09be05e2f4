"""What `dflash s3 pull` refuses before it writes a byte, and how it writes without following a link.

A manifest read from S3 is input: whoever can write to the bucket wrote it. `check_manifest` already
refuses unsafe paths; here the rest, each an S3Error (exit 2) naming the entry, before anything moves:

- a symlink entry whose target does not resolve inside the destination: an absolute target, a `..`
  that climbs out, or a walk through other links (the manifest's own, or links already in the folder
  that the pull leaves alone) that ends outside; a loop of links is refused too;
- an entry whose path passes through a symlink already in the destination (a pull never writes
  through one), or meets a real folder where the manifest puts a file or a symlink;
- an entry under the pull's own partial folder (`.s3-partial`);
- a `locations` entry (where a salvage set pushed with `--reference` keeps a file) outside the set's
  own prefix, unless the user named a prefix holding it with `--allow-location s3://BUCKET/PREFIX`.

Then every file and link is put in place through folder handles opened with O_NOFOLLOW (`place_file`,
`place_link`): a link planted between the check and the write fails that entry, it is never followed.
Light side: stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainer.s3 import S3Error
from trainer.s3 import client as s3lib

MAX_HOPS = 40  # as the kernel's own limit on links followed in one path walk


def _escape(dest: Path, rel: str, links: dict[str, str], files: dict[str, Any]) -> str | None:
    """Why the symlink entry `rel` would point outside `dest` once the pull is done, or None.

    Walks the target one part at a time over the folder as the pull leaves it: the manifest's links,
    and links already in `dest` at paths the manifest does not replace. `..` is applied after the
    link before it is followed, as the kernel does, so `d/../x` through a link `d` is not `x`."""
    cur: list[str] = rel.split("/")[:-1]
    todo = links[rel].split("/")
    if links[rel].startswith("/"):
        return f"its target {links[rel]!r} is absolute"
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not cur:
                return f"its target {links[rel]!r} climbs out of {dest} ('..')"
            cur.pop()
            continue
        here = "/".join([*cur, part])
        target = links.get(here)
        if target is None and here not in files and (dest / here).is_symlink():
            target = os.readlink(dest / here)  # a link already here that this pull leaves alone
        if target is None:
            cur.append(part)
            continue
        hops += 1
        if hops > MAX_HOPS:
            return f"its target {links[rel]!r} is a loop of links"
        if target.startswith("/"):
            return f"its target {links[rel]!r} passes through {here} -> {target!r}, outside {dest}"
        todo = target.split("/") + todo
    return None


def _links_on_the_way(root: Path, rel: str, seen: dict[str, bool]) -> str | None:
    """The first folder on `rel`'s way under `root` that is a symlink now, or None (`seen` caches)."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        sub = "/".join(parts[:i])
        if sub not in seen:
            seen[sub] = (root / sub).is_symlink()
        if seen[sub]:
            return sub
    return None


def check_entries(
    dest: Path, files: dict[str, dict[str, Any]], links: dict[str, str], partial_dir: str
) -> None:
    """S3Error (exit 2, nothing written) for a link entry whose target lies outside `dest`, an entry
    that passes through a symlink in `dest`, meets a real folder, or lies under `partial_dir`."""
    bad: list[str] = []
    seen: dict[str, bool] = {}
    pseen: dict[str, bool] = {}
    for rel in sorted({**files, **links}):
        kind = "symlink entry" if rel in links else "entry"
        if rel.split("/")[0] == partial_dir:
            bad.append(f"{kind} {rel!r} lies under {partial_dir}/, the pull's own partial folder")
            continue
        if rel in links:
            why = _escape(dest, rel, links, files)
            if why:
                bad.append(f"symlink entry {rel!r}: {why}")
                continue
        via = _links_on_the_way(dest, rel, seen)
        if via is not None:
            bad.append(
                f"{kind} {rel!r}: {dest / via} is a symlink here ({os.readlink(dest / via)!r}) and a pull "
                "never writes through one; remove it"
            )
            continue
        via = _links_on_the_way(dest / partial_dir, rel + "/x", pseen) if rel in files else None
        if via is not None:
            bad.append(f"{kind} {rel!r}: {dest / partial_dir / via} is a symlink; remove {partial_dir}/")
            continue
        path = dest / rel
        if path.is_dir() and not path.is_symlink():
            what = f"a symlink to {links[rel]!r}" if rel in links else "a file"
            bad.append(
                f"{kind} {rel!r} is {what} but {path} is a real folder here; move it away (or pull "
                "into an empty folder)"
            )
    if (dest / partial_dir).is_symlink():
        bad.append(f"{dest / partial_dir} is a symlink; remove it (a pull never writes through one)")
    if bad:
        raise S3Error(
            f"{len(bad)} manifest entr{'y' if len(bad) == 1 else 'ies'} cannot be pulled into {dest} safely; "
            "nothing was downloaded: " + "; ".join(bad[:10]) + (" ..." if len(bad) > 10 else "")
        )


def within(ref: s3lib.S3Location, allowed: s3lib.S3Location) -> bool:
    """`ref` lies in `allowed`'s bucket, under its prefix by whole path parts."""
    return ref.bucket == allowed.bucket and (
        not allowed.prefix or ref.prefix == allowed.prefix or ref.prefix.startswith(allowed.prefix + "/")
    )


def check_locations(
    loc: s3lib.S3Location, locations: dict[str, Any], files: dict[str, Any], allowed: list[str] | tuple = ()
) -> dict[str, str]:
    """The `locations` entries the pull may read (rel -> s3:// URL): each under the set's own prefix
    or under a prefix the user allowed (`--allow-location`); any other is an S3Error (exit 2)."""
    allow = [s3lib.parse_s3_url(a) for a in allowed]
    out: dict[str, str] = {}
    bad: list[str] = []
    for rel, url in sorted(locations.items()):
        if rel not in files:
            continue  # names no file of this set: never read
        try:
            ref = s3lib.parse_s3_url(url)
        except S3Error:
            bad.append(f"{rel!r} -> {url!r} is not an s3://BUCKET/KEY address")
            continue
        if not ref.prefix:
            bad.append(f"{rel!r} -> {url!r} names a bucket, not an object")
        elif within(ref, loc) or any(within(ref, a) for a in allow):
            out[rel] = url
        else:
            bad.append(f"{rel!r} -> {url}")
    if bad:
        raise S3Error(
            f"the manifest at {loc.url()} sends {len(bad)} read(s) outside its own prefix: "
            + "; ".join(bad[:10])
            + (" ..." if len(bad) > 10 else "")
            + ". Nothing was read. A salvage set pushed with --reference keeps files in earlier sets: "
            "if you trust them, name each such prefix with --allow-location s3://BUCKET/PREFIX"
        )
    return out


# ---------------------------------------------------------------- writing without following links


def _open_parent(dest: Path, rel: str) -> tuple[int, str]:
    """A handle on the folder that holds `dest/rel`, reached (and made) one part at a time with
    O_NOFOLLOW, and the entry's own name: an OSError names a symlink or a file on the way."""
    parts = rel.split("/")
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, name in enumerate(parts[:-1]):
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                raise OSError(
                    f"{'/'.join(parts[: i + 1])} is a symlink or not a folder: not written through"
                ) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def place_file(part: Path, dest: Path, rel: str, mtime_ns: int | None) -> None:
    """Rename the proven partial file `part` to `dest/rel` (the manifest's mtime kept, 0644). A symlink
    at `dest/rel` itself is replaced (rename never follows it)."""
    if mtime_ns is not None:
        os.utime(part, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
    os.chmod(part, 0o644)
    fd, name = _open_parent(dest, rel)
    try:
        os.replace(part, name, dst_dir_fd=fd)
    finally:
        os.close(fd)


def place_link(dest: Path, rel: str, to: str) -> bool:
    """Plant the symlink `dest/rel` -> `to` (temp name, then rename); False when it is already there."""
    fd, name = _open_parent(dest, rel)
    try:
        try:
            if os.readlink(name, dir_fd=fd) == to:
                return False
        except OSError:
            pass
        tmp = f".{name}.link-tmp"
        try:
            os.unlink(tmp, dir_fd=fd)
        except FileNotFoundError:
            pass
        os.symlink(to, tmp, dir_fd=fd)
        try:
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError:
            os.unlink(tmp, dir_fd=fd)
            raise
        return True
    finally:
        os.close(fd)


def open_partial(part: Path):
    """The partial file, opened for appending without following a symlink at its own name."""
    return os.fdopen(os.open(part, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600), "ab")
