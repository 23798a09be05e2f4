"""The "Watch a run" page: in the nav, with the tunnel command, the screenshot, and every option of
`dflash monitor` / `dflash status` (kept current against the real parser); the page's assets ship in the
package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from trainer.cli import build_parser
from trainer.monitor.server import load_static

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "monitor.md"


def subparser(name: str):
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices[name]


def options(name: str) -> set[str]:
    return {
        o for a in subparser(name)._actions for o in a.option_strings if o.startswith("--") and o != "--help"
    }


def test_page_is_in_the_nav_with_tunnel_and_screenshot():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    assert {"Watch a run": "monitor.md"} in nav
    text = PAGE.read_text()
    assert "ssh -N -L 8080:127.0.0.1:8080 " in text
    image = re.search(r"!\[[^\]]+\]\((img/[^)]+\.png)\)", text).group(1)
    png = (REPO / "docs" / image).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000


def test_every_option_is_documented():
    text = PAGE.read_text()
    documented = set(re.findall(r"`(--[a-z-]+)", text))
    missing = (options("monitor") | options("status")) - documented
    assert not missing, f"options missing from docs/monitor.md: {sorted(missing)}"


def test_static_assets_are_package_data_and_all_served():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "static/*" in data["trainer.monitor"]
    on_disk = {p.name for p in (REPO / "trainer" / "monitor" / "static").iterdir() if p.is_file()}
    assert set(load_static()) == on_disk >= {"index.html", "app.js", "style.css"}
    for name, (body, _) in load_static().items():  # no CDN: nothing is fetched from outside the package
        body = body.replace(b'xmlns="http://www.w3.org/2000/svg"', b"")  # a namespace name, not a fetch
        assert b"http://" not in body and b"https://" not in body and b"//cdn" not in body, name
