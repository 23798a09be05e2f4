"""What tests/ansible/test_runbook_page.py needs to run docs/node-to-drafter.md from the page itself: its
marked blocks, the declared substitutions, the tiny chat model the Hub stand-in serves, a checkout of the
repository for the page's relative paths, and ansible-playbook's results (the json stdout callback)."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.ansible.conftest import REPO

PAGE = REPO / "docs" / "node-to-drafter.md"
MARK = re.compile(r"<!-- page-test: step (\d+) (file (\S+)|run|node|serve) -->")
MODEL = "tiny-org/target"


@dataclass
class Block:
    step: int
    kind: str  # file, run, node, serve
    path: str | None
    text: str


def page_blocks(text: str) -> list[Block]:
    """The marked fenced blocks in page order (other comments may stand between a marker and its fence)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = MARK.fullmatch(lines[i].strip())
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                assert not lines[j].strip() or lines[j].lstrip().startswith("<!--"), (
                    f"marker without a block: {m[0]}"
                )
                j += 1
            k = j + 1
            while lines[k].rstrip() != "```":
                k += 1
            kind = m[2].split()[0]
            out.append(Block(int(m[1]), kind, m[3], "\n".join(lines[j + 1 : k]) + "\n"))
            i = k
        i += 1
    return out


def commands(block: str) -> list[str]:
    """A shell block's commands, continuation lines joined."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


def substitutions(port: int) -> list[tuple[str, str]]:
    return [
        ("Qwen/Qwen3-32B", MODEL),  # the model -> the tiny model the Hub stand-in serves
        ("my-a100", "rented"),  # the node's name in the inventory -> the container's
        ("192.0.2.10", "127.0.0.1"),  # its address and port -> the container's
        ("14085", str(port)),
        ("a100:", "cpu:"),  # its group: no GPU here
        ("my-bucket", "salvage"),  # the bucket -> radosgw's
    ]


def tiny_chat_target(out: Path) -> Path:
    """A tiny Qwen3 that vLLM serves on CPU (head size 64) with a word-level tokenizer (`w<i>` is token i)
    and a chat template, its embedding padded past the tokenizer (528 rows for 512 ids) as Qwen3's is:
    `dflash init` finds its mask token there, as it does for Qwen3-32B."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trainer.demo import synth

    synth.tiny_target(out, num_layers=4, hidden=256, vocab=528)
    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special)} | {f"w{i}": i for i in range(len(special), 512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(out))
    return out


def checkout(dest: Path) -> Path:
    """The controller's repository root for the page: this repository's playbooks, roles, config and
    inventory files linked, nothing of a developer's own (*.private.yml, vault.yml) taken along."""
    dest.mkdir()
    for name in ("playbooks", "roles", "ansible.cfg", "requirements", "scripts"):
        (dest / name).symlink_to(REPO / name)
    inv = dest / "inventory"
    (inv / "group_vars" / "all").mkdir(parents=True)
    (inv / "hosts.yml").symlink_to(REPO / "inventory" / "hosts.yml")
    for f in (REPO / "inventory" / "group_vars").iterdir():
        if f.is_file():
            (inv / "group_vars" / f.name).symlink_to(f)
    for f in (REPO / "inventory" / "group_vars" / "all").iterdir():
        if f.name != "vault.yml":
            (inv / "group_vars" / "all" / f.name).symlink_to(f)
    return dest


class Played:
    """One ansible-playbook run (the json stdout callback): its exit status, task results and stats."""

    def __init__(self, cmd: str, proc: subprocess.CompletedProcess):
        self.cmd, self.rc, self.stderr = cmd, proc.returncode, proc.stderr
        self.stdout = proc.stdout
        try:
            self.doc = json.loads(proc.stdout[proc.stdout.index("{") :])
        except ValueError:  # no play ran (a syntax or option error): what it said is in stderr
            self.doc = {"plays": [], "stats": {}}

    def ok(self) -> bool:
        return self.rc == 0

    def tasks(self, host: str):
        for play in self.doc["plays"]:
            for t in play["tasks"]:
                if host in t["hosts"]:
                    yield t["task"]["name"], t["hosts"][host]

    def task_results(self, name: str, host: str) -> list[dict]:
        return [r for n, r in self.tasks(host) if n == name or n.endswith(f" : {name}")]

    def changed(self, host: str) -> int:
        return self.doc["stats"].get(host, {}).get("changed", 0)

    def changed_tasks(self, host: str) -> list[str]:
        return [n for n, r in self.tasks(host) if r.get("changed")]

    def failures(self) -> str:
        out = [
            f"{n}: {str(r.get('msg', ''))[-1500:]} {str(r.get('stderr', ''))[-1500:]}"
            for play in self.doc["plays"]
            for t in play["tasks"]
            for n, r in [(t["task"]["name"], h) for h in t["hosts"].values()]
            if r.get("failed") or r.get("unreachable")
        ]
        return f"{self.cmd}\n" + ("\n".join(out) or self.stdout[-3000:] + self.stderr[-3000:])
