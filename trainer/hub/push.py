"""An export onto the Hugging Face Hub with its model card (`dflash export --push-to-hub ORG/NAME`).

After `dflash export` has written and reload-verified the speculators folder, the folder and a model
card generated from the run (trainer/hub/card.py, written beside the weights as README.md) go to the
model repo ORG/NAME on branch `--revision` (default main), in one commit through huggingface_hub's
own client (`HfApi.create_repo(exist_ok)`, `create_branch(exist_ok)`, `create_commit`):

- idempotent: the branch's file list with each file's digest (`model_info(files_metadata=True)`, the
  listing `dflash hub pull` reads: LFS sha256, git blob id) is compared with the folder; only the
  files that differ go into the commit, and with none no commit is made (`changed: false`, 0 bytes);
- resumable: for the large files the client asks the Hub which objects it already has (LFS batch /
  Xet dedup), so an object uploaded by a push that died before its commit is not sent again; rerun
  the same command (its `--out` then holds the export: pushed as it is, not exported again);
- the token: `--token-file` (0600, as `dflash hub pull`) or huggingface_hub's own (`HF_TOKEN`, the
  stored login); never in argv, the events or the card. Checked with the repo name before the export
  starts, so a push that cannot happen costs no export.
Light at import: huggingface_hub is imported when the push runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer import jsonin
from trainer.hub.card import render_card
from trainer.hub.pull import (
    HubError,
    HubFailed,
    check_endpoint,
    listing,
    local_state,
    parse_spec,
    read_token,
    unreachable,
)
from trainer.store.fsutil import atomic_write_text

EXPORT_INFO = "dflash_export.json"  # written by trainer/export.py beside the weights
CARD = "README.md"


@dataclass
class HubPush:
    repo: str
    revision: str
    token: str
    endpoint: str | None = None

    def reuses(self, out: Path, checkpoint: Path) -> bool:
        """True when `out` already holds an export of `checkpoint` (a rerun after a failed push: push
        it as it is); False when it does not exist; an error for anything else there."""
        out = Path(out)
        if not out.exists():
            return False
        try:
            source = Path(jsonin.loads((out / EXPORT_INFO).read_bytes())["source"]).resolve()
        except (OSError, ValueError, KeyError, TypeError):
            raise HubError(f"--out {out} exists and is not a finished export: choose a new folder") from None
        from trainer.store.checkpoint import LATEST, resolve_checkpoint

        given = Path(checkpoint)  # RUN/checkpoints/latest: the checkpoint it names
        given = ((resolve_checkpoint(given) if given.name == LATEST else None) or given).resolve()
        if source != given and given not in source.parents:
            raise HubError(f"--out {out} holds an export of {source}, not of --checkpoint {checkpoint}")
        print(f"{out} already holds the export of {source}: pushing it as it is", flush=True)
        return True

    def run(self, out: Path) -> dict[str, Any]:
        """Write the card into `out` and push the files the branch lacks; returns what was sent."""
        from huggingface_hub import CommitOperationAdd, HfApi
        from huggingface_hub.errors import HfHubHTTPError

        out = Path(out)
        try:
            info = jsonin.loads((out / EXPORT_INFO).read_bytes())
            card = render_card(info, self.repo)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HubError(
                f"{out}/{EXPORT_INFO} is not a finished export's record ({type(exc).__name__}: {exc}): "
                "export again into a new folder"
            ) from None
        atomic_write_text(out / CARD, card)
        files = {p.relative_to(out).as_posix(): p for p in sorted(out.rglob("*")) if p.is_file()}
        files = {
            rel: p for rel, p in files.items() if not any(part.startswith(".") for part in rel.split("/"))
        }
        api = HfApi(endpoint=self.endpoint, token=self.token)
        where = f"hf://{self.repo}@{self.revision}"
        try:
            api.create_repo(self.repo, exist_ok=True)
            if self.revision != "main":
                api.create_branch(self.repo, branch=self.revision, exist_ok=True)
            head, remote = listing(api, self.repo, self.revision)
            todo = [
                rel
                for rel, p in files.items()
                if rel not in remote or local_state(p, remote[rel])[0] != "same"
            ]
            if todo:
                head = api.create_commit(
                    self.repo,
                    [CommitOperationAdd(rel, str(files[rel])) for rel in todo],
                    commit_message=f"dflash export of {Path(str(info.get('source'))).name}",
                    revision=self.revision,
                ).oid
        except Exception as exc:  # noqa: BLE001 - the HTTP and network errors only, the rest re-raised
            if not isinstance(exc, HfHubHTTPError) and not unreachable(exc):
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise HubFailed(
                f"push to {where}: the Hub at {api.endpoint} did not answer: {type(exc).__name__}: {first}"
            ) from None
        report = {
            "hub": where,
            "commit": head,
            "files": len(files),
            "changed": bool(todo),
            "changed_files": todo,
            "changed_bytes": sum(files[rel].stat().st_size for rel in todo),
        }
        if todo:
            print(
                f"pushed {len(todo)} of {len(files)} files ({report['changed_bytes'] / 2**20:.2f} MiB) to "
                f"{where}: commit {head[:12]}",
                flush=True,
            )
        else:
            print(
                f"{where} already has these {len(files)} files: nothing sent (commit {head[:12]})", flush=True
            )
        return report


def prepare(spec: str, revision: str | None = None, token_file: str | None = None) -> HubPush:
    """The push target, checked before any export work: ORG/NAME, the branch, a token, online."""
    repo, rev = parse_spec(spec, revision)
    if "/" not in repo:
        raise HubError(f"--push-to-hub {spec!r}: name the repo as ORG/NAME (your user or organization)")
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise HubError("HF_HUB_OFFLINE is set: --push-to-hub uploads, so run it without it")
    check_endpoint(os.environ.get("HF_ENDPOINT") or None, "HF_ENDPOINT")
    token = read_token(token_file) or get_token()
    if not token:
        raise HubError(
            "--push-to-hub needs a Hub token with write access: HF_TOKEN, `hf auth login`, or --token-file"
        )
    return HubPush(repo, rev, token, os.environ.get("HF_ENDPOINT") or None)
