"""The resumable download's shared frame (trainer/store/resumable.py), as `dflash hub pull` and
`dflash s3 pull` use it: a file is placed only when its bytes are the listed ones, refused bytes are
deleted, a refused resume is fetched once more from the start, one file's failure is its result's error.
The sources' own fetches run against the Hub stand-in and S3 servers (tests/integration)."""

from pathlib import Path

from trainer.store.resumable import fetch_all, fetch_verified, nothing_fetched, plan_pull, resume_tag_file


class Source:
    """Serves `payloads` one per fetch into `part`, the first one resumed from `resumed` bytes."""

    def __init__(self, part: Path, payloads: list[bytes], resumed: int = 0):
        self.part, self.payloads, self.resumed, self.calls = part, list(payloads), resumed, 0

    def __call__(self) -> dict:
        data = self.payloads[self.calls]
        offset = self.resumed if self.calls == 0 else 0
        self.calls += 1
        self.part.parent.mkdir(parents=True, exist_ok=True)
        self.part.write_bytes(data)
        resume_tag_file(self.part).write_text("tag")
        return {"resumed_from": offset, "bytes": len(data) - offset, "data": data}


def right(got: dict) -> str | None:
    return None if got["data"] == b"right" else f"{got['data']!r}, the listing says b'right'"


def test_right_bytes_are_placed_and_the_partial_tag_goes(tmp_path):
    part, placed = tmp_path / ".partial" / "f", []
    res = fetch_verified("f", part, Source(part, [b"right"]), right, placed.append)
    assert res == {"path": "f", "bytes": 5, "resumed_from": 0, "ok": True} and len(placed) == 1
    assert not resume_tag_file(part).exists()


def test_a_refused_resume_is_fetched_once_more_from_the_start(tmp_path):
    part, placed = tmp_path / "f.part", []
    src = Source(part, [b"wrong", b"right"], resumed=3)
    res = fetch_verified("f", part, src, right, placed.append)
    assert res["ok"] and src.calls == 2 and res["resumed_from"] == 3 and res["bytes"] == 2 + 5


def test_a_fresh_download_that_is_refused_is_deleted_not_placed_and_not_fetched_again(tmp_path):
    part, placed = tmp_path / "f.part", []
    src = Source(part, [b"wrong", b"right"])
    res = fetch_verified("f", part, src, right, placed.append)
    assert not res["ok"] and src.calls == 1 and placed == [] and not part.exists()
    assert res["error"] == "refused: b'wrong', the listing says b'right' (deleted, not placed)"
    again = Source(part, [b"wrong", b"wrong"])  # a source whose transfers can go wrong in flight
    res = fetch_verified("f", part, again, right, placed.append, again_when_fresh=True)
    assert again.calls == 2 and res["error"].endswith("(deleted, not placed, after two downloads)")


def test_one_file_failing_is_its_result_and_the_totals_count_the_others(tmp_path):
    def one(rel: str) -> dict:
        def fetch() -> dict:
            if rel == "bad":
                raise OSError("connection reset")
            return Source(tmp_path / rel, [b"right"])()

        return fetch_verified(rel, tmp_path / rel, fetch, right, lambda got: None)

    totals, failed = fetch_all(["a", "bad", "b"], one, workers=2)
    assert totals == {"downloaded": 2, "downloaded_bytes": 10, "resumed_bytes": 0}
    assert failed == [{"path": "bad", "error": "OSError: connection reset"}]
    assert nothing_fetched() == {"downloaded": 0, "downloaded_bytes": 0, "resumed_bytes": 0, "failed": []}


def test_the_plan_counts_what_is_left_and_refuses_what_does_not_fit(tmp_path):
    files = {"a": {"size": 10}, "b": {"size": 4}}
    (tmp_path / ".p").mkdir()
    (tmp_path / ".p" / "a").write_bytes(b"123")  # a killed pull's partial: 7 bytes still to fetch

    plan = plan_pull(
        tmp_path, files, ".p", lambda path, entry: ("same", "x") if path.name == "b" else ("missing", None)
    )
    head = plan.report(tmp_path, files, check=True)
    assert head["to_download"] == 1 and head["to_download_bytes"] == 7 and head["present"] == 1
    assert head["plan"] == [{"path": "a", "why": "missing", "size": 10, "partial_bytes": 3}]
    assert plan.shortfall(tmp_path) is None
    plan.free = 6
    assert "GiB to download but only" in plan.shortfall(
        tmp_path
    ) and "nothing was downloaded" in plan.shortfall(tmp_path)
