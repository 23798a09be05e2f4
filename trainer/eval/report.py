"""The evaluation report: report.json (the contract), a markdown summary and a PNG beside it, and
the side-by-side comparison of several drafters. Field meanings: docs/evaluate.md.
matplotlib (Agg) is imported only to draw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.eval.harness import PromptResult
from trainer.eval.lossless import verdict_text
from trainer.store.fsutil import atomic_write_bytes, atomic_write_text

REPORT_SCHEMA_VERSION = 1


def aggregate(results: list[PromptResult], block_size: int) -> dict[str, Any]:
    """tau (pooled over all rounds), per-position acceptance (slot k accepted when accepted >= k),
    the histogram of accepted lengths, throughput."""
    accepted = [a for r in results for a in r.accepted]
    rounds = len(accepted)
    hist = [0] * block_size
    for a in accepted:
        hist[a] += 1
    new_tokens = sum(len(r.tokens) for r in results)
    decode_s = sum(r.wall_s for r in results)
    return {
        "tau": (sum(accepted) + rounds) / rounds if rounds else None,
        "rounds": rounds,
        "per_position_acceptance": [
            (sum(1 for a in accepted if a >= k) / rounds if rounds else None) for k in range(1, block_size)
        ],
        "acceptance_histogram": {str(a): hist[a] for a in range(block_size)},
        "new_tokens": new_tokens,
        "decode_s": round(decode_s, 4),
        "tokens_per_s": new_tokens / decode_s if decode_s > 0 else None,
    }


def per_prompt(results: list[PromptResult], verdicts: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prompt figures; `lossless`: True (exact, or a near tie), False (a mismatch) or None (not
    checked), `lossless_status` and, unless exact, `lossless_check` (trainer/eval/lossless.py)."""
    return [
        {
            "index": i,
            "prompt_tokens": r.prompt_tokens,
            "new_tokens": len(r.tokens),
            "rounds": r.rounds,
            "tau": r.tau,
            "accepted": r.accepted,
            "stopped": r.stopped,
            "wall_s": round(r.wall_s, 4),
            "lossless": None if i not in verdicts else verdicts[i]["status"] != "mismatch",
            "lossless_status": verdicts[i]["status"] if i in verdicts else None,
            **({"lossless_check": verdicts[i]} if i in verdicts and verdicts[i]["status"] != "exact" else {}),
            "tokens": r.tokens,
        }
        for i, r in enumerate(results)
    ]


def fmt_number(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def render_markdown(rep: dict[str, Any], png_name: str | None) -> str:
    ll = rep["lossless"]
    lines = [
        f"# Drafter evaluation: {rep['label']}",
        "",
        f"- drafter: `{rep['drafter']}`",
        f"- target: `{rep['target']}`",
        f"- prompts: `{rep['prompts']}` ({rep['num_prompts']} prompts, up to {rep['max_new_tokens']} new "
        f"tokens; sha256 {((rep.get('prompt_set') or {}).get('sha256') or '-')[:16]})",
        f"- loop: {rep['mode']}, block size {rep['block_size']}, device {rep['device']}",
        "",
        "| tau | rounds | new tokens | tokens/s | target alone tokens/s | wall s | lossless |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        (
            f"| **{fmt_number(rep['tau'])}** | {rep['rounds']} | {rep['new_tokens']} | "
            f"{fmt_number(rep['tokens_per_s'], 1)} | "
            f"{fmt_number(ll.get('target_tokens_per_s'), 1)} | {fmt_number(rep['wall_s'], 1)} | "
            f"{verdict_text(ll)} |"
        ),
        "",
    ]
    lines += render_near_ties(rep)
    for w in rep["warnings"]:
        lines.append(f"> **warning**: {w}")
    if rep["warnings"]:
        lines.append("")
    lines += render_served(rep)
    lines += render_trees(rep)
    lines += [
        "## Acceptance by position",
        "",
        "| slot | " + " | ".join(str(k) for k in range(1, rep["block_size"])) + " |",
        "| --- |" + " --- |" * (rep["block_size"] - 1),
        "| accepted | " + " | ".join(fmt_number(p) for p in rep["per_position_acceptance"]) + " |",
        "",
    ]
    hist = rep["acceptance_histogram"] or {"-": "-"}
    lines += [
        "## Accepted drafts per round",
        "",
        "| accepted | " + " | ".join(hist) + " |",
        "| --- |" + " --- |" * len(hist),
        "| rounds | " + " | ".join(str(v) for v in hist.values()) + " |",
        "",
    ]
    if png_name:
        lines += [f"![acceptance]({png_name})", ""]
    lines += [
        "## Per prompt",
        "",
        "| # | prompt tokens | new tokens | rounds | tau | stopped | lossless |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in rep["per_prompt"][:200]:
        mark = {True: "ok", False: "MISMATCH", None: "-"}[p["lossless"]]
        check = p.get("lossless_check")
        if check:
            mark = f"{'near-tie' if p['lossless'] else 'MISMATCH'}: {check['detail']}"
        lines.append(
            f"| {p['index']} | {p['prompt_tokens']} | {p['new_tokens']} | {p['rounds']} | "
            f"{fmt_number(p['tau'])} | "
            f"{p['stopped']} | {mark} |"
        )
    return "\n".join(lines) + "\n"


def render_near_ties(rep: dict[str, Any]) -> list[str]:
    """A line on the near ties of the lossless check (chain and trees), when there are any."""
    checks = [rep["lossless"]] + [t["lossless"] for t in rep.get("trees") or []]
    near = sum(len(ll.get("near_ties") or []) for ll in checks)
    if not near:
        return []
    tol = rep["lossless"].get("tolerance") or {}
    return [
        f"Lossless: {near} checked output(s) left the target's one-token greedy decoding at a near tie "
        f"(the reference's top-logit gap to the committed token within {fmt_number(tol.get('ulps'), 0)} "
        f"x eps x max|logit|, {tol.get('dtype')}), each committed token being its verify forward's own "
        "choice: not a failure. The comparison of such a prompt stops at that token (the texts differ "
        "after it).",
        "",
    ]


def render_trees(rep: dict[str, Any]) -> list[str]:
    """The "tree verification" section (`--tree-budget`): tau per budget beside the chain, what each
    tree costs the target, its lossless check and its acceptance per depth."""
    trees = rep.get("trees") or []
    if not trees:
        return []
    depths = rep["block_size"] - 1
    lines = [
        "## Tree verification (DDTree)",
        "",
        "| budget | tau | x chain | target tokens / round | lossless | "
        + " | ".join(f"d{k}" for k in range(1, depths + 1))
        + " |",
        "| --- | --- | --- | --- | --- |" + " --- |" * depths,
        f"| chain | {fmt_number(rep['tau'])} | 1 | {rep['block_size']} | - | "
        + " | ".join(fmt_number(p, 2) for p in rep["per_position_acceptance"])
        + " |",
    ]
    for t in trees:
        lines.append(
            f"| {t['budget']} | **{fmt_number(t['tau'])}** | {fmt_number(t['tau_over_chain'], 2)} | "
            f"{fmt_number(t['target_tokens_per_round'], 1)} | {verdict_text(t['lossless'])} | "
            + " | ".join(fmt_number(p, 2) for p in t["per_depth_acceptance"])
            + " |"
        )
    return lines + [""]


def render_served(rep: dict[str, Any]) -> list[str]:
    """The "served by vLLM" section (`dflash eval --engine vllm|both`): vLLM's own counts, and with
    `both` whether they agree with the harness and the checks that tell the usual causes apart."""
    sv = rep.get("served")
    if not sv:
        return []
    view = sv["engine_view"]
    lines = [
        f"## Served by {sv['engine']} ({sv['dtype']}, {sv['device']})",
        "",
        "The number a server running this drafter shows: vLLM's own spec-decode counters, "
        "tau = 1 + accepted / drafts.",
        "",
        "| tau (vLLM) | drafts | accepted | tokens/s | start s | layers tapped | mask token | causal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| **{fmt_number(sv['tau'])}** | {sv['drafts']} | {sv['accepted']} | "
        f"{fmt_number(sv['tokens_per_s'], 1)} | {fmt_number(sv['start_s'], 1)} | {view['aux_layer_ids']} | "
        f"{view['mask_token_id']} | {view['causal']} |",
        "",
        "| slot | " + " | ".join(str(k) for k in range(1, len(sv["per_position_acceptance"]) + 1)) + " |",
        "| --- |" + " --- |" * len(sv["per_position_acceptance"]),
        "| accepted (vLLM) | " + " | ".join(fmt_number(p) for p in sv["per_position_acceptance"]) + " |",
        "",
    ]
    agree = rep.get("engine_agreement")
    if agree:
        verdict = "agree" if agree["ok"] else "**DISAGREE**"
        lines += [
            f"Harness tau {fmt_number(agree['tau_harness'])}, vLLM tau {fmt_number(agree['tau_vllm'])}: "
            f"{verdict} (difference {fmt_number(agree['difference'])}, tolerance {agree['tolerance']}).",
            "",
        ]
    checks = agree["checks"] if agree else sv["checks"]
    lines += ["| check | ok | detail |", "| --- | --- | --- |"]
    lines += [f"| {c['check']} | {'ok' if c['ok'] else 'NO'} | {c['detail']} |" for c in checks]
    lines.append("")
    return lines


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_png(fig, path: Path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def plot_report(rep: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    slots = list(range(1, rep["block_size"]))
    a1.bar(slots, [p or 0 for p in rep["per_position_acceptance"]], color="#3b7dd8")
    a1.set(
        xlabel="draft slot k",
        ylabel="P(slot k accepted)",
        ylim=(0, 1),
        xticks=slots,
        title=f"per-position acceptance (tau {fmt_number(rep['tau'])})",
    )
    taus = [p["tau"] or 0 for p in rep["per_prompt"]]
    a2.bar(range(len(taus)), taus, color="#e08a2c")
    if rep["tau"]:
        a2.axhline(rep["tau"], color="k", lw=1, ls="--", label=f"pooled tau {rep['tau']:.2f}")
    for t, color in zip(rep.get("trees") or [], ("#2a9d4b", "#8e44ad", "#c0392b", "#16a085")):
        if t["tau"]:
            a2.axhline(t["tau"], color=color, lw=1, label=f"tree {t['budget']}: tau {t['tau']:.2f}")
    if rep["tau"]:
        a2.legend(loc="upper right")
    a2.set(xlabel="prompt", ylabel="tau", ylim=(0, rep["block_size"]), title="tau per prompt")
    fig.suptitle(rep["label"])
    _save_png(fig, path)
    plt.close(fig)


def sidecars(out: Path) -> tuple[Path, Path]:
    out = Path(out)
    return out.with_suffix(".md"), out.with_suffix(".png")


def write_report(rep: dict[str, Any], out: Path) -> list[Path]:
    md, png = sidecars(out)
    plot_report(rep, png)
    atomic_write_text(md, render_markdown(rep, png.name))
    atomic_write_text(Path(out), json.dumps(rep, indent=1))
    return [Path(out), md, png]


# ---------------------------------------------------------------- several drafters
def comparison_rows(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "label": r["label"],
            "tau": r["tau"],
            "tokens_per_s": r["tokens_per_s"],
            "rounds": r["rounds"],
            "per_position_acceptance": r["per_position_acceptance"],
            "lossless_ok": r["lossless"]["ok"],
            "tau_vllm": (r.get("served") or {}).get("tau"),
            "tree_tau": {str(t["budget"]): t["tau"] for t in r.get("trees") or []},
        }
        for r in reports
    ]


def render_table(reports: list[dict[str, Any]]) -> str:
    """The side-by-side text table `dflash eval` prints for several drafters."""
    B = max(r["block_size"] for r in reports)
    width = max(8, *(len(r["label"]) for r in reports))
    served = any(r.get("served") for r in reports) and any(r["mode"] != "served" for r in reports)
    budgets = sorted({t["budget"] for r in reports for t in r.get("trees") or []})
    head = (
        f"{'drafter':{width}}  {'tau':>6}  "
        + (f"{'vLLM':>6}  " if served else "")
        + "".join(f"{'tree' + str(b):>8}  " for b in budgets)
        + f"{'tok/s':>8}  "
        + " ".join(f"{'p' + str(k):>5}" for k in range(1, B))
    )
    out = [head, "-" * len(head)]
    for r in reports:
        pp = r["per_position_acceptance"] + [None] * (B - r["block_size"])
        tau_vllm = (r.get("served") or {}).get("tau")
        tree_tau = {t["budget"]: t["tau"] for t in r.get("trees") or []}
        out.append(
            f"{r['label']:{width}}  {fmt_number(r['tau']):>6}  "
            + (f"{fmt_number(tau_vllm):>6}  " if served else "")
            + "".join(f"{fmt_number(tree_tau.get(b)):>8}  " for b in budgets)
            + f"{fmt_number(r['tokens_per_s'], 1):>8}  "
            + " ".join(f"{fmt_number(p, 2):>5}" for p in pp)
        )
    return "\n".join(out)


def plot_comparison(reports: list[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    for r in reports:
        slots = list(range(1, r["block_size"]))
        a1.plot(slots, [p or 0 for p in r["per_position_acceptance"]], marker="o", label=r["label"])
    a1.set(xlabel="draft slot k", ylabel="P(slot k accepted)", ylim=(0, 1), title="per-position acceptance")
    a1.legend()
    a2.bar([r["label"] for r in reports], [r["tau"] or 0 for r in reports], color="#3b7dd8")
    a2.set(ylabel="tau", title="tau")
    a2.tick_params(axis="x", rotation=20)
    _save_png(fig, path)
    plt.close(fig)


def write_comparison(reports: list[dict[str, Any]], out: Path) -> list[Path]:
    md, png = sidecars(out)
    plot_comparison(reports, png)
    text = [
        "# Drafter comparison",
        "",
        f"target `{reports[0]['target']}`, prompts `{reports[0]['prompts']}`",
        "",
        "```",
        render_table(reports),
        "```",
        "",
        f"![comparison]({png.name})",
        "",
    ]
    for r in reports:
        text += [f"- {r['label']}: `{r['drafter']}`"] + [f"  - warning: {w}" for w in r["warnings"]]
    atomic_write_text(md, "\n".join(text) + "\n")
    doc = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "comparison": comparison_rows(reports),
        "reports": reports,
    }
    atomic_write_text(Path(out), json.dumps(doc, indent=1))
    return [Path(out), md, png]
