"""The docs as a user meets them: the site builds strict (no broken link or anchor, no page left out of
the nav), the generated reference pages say what the code does today, every preflight check has its
fixes written down, the README stays a front door whose links lead somewhere, and the commands the
docs mark as runnable on this machine run as written."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
DOCS = REPO / "docs"
README = REPO / "README.md"
#: The line before a fenced block whose commands run on this machine (inventory/local) as written.
RUNNABLE = "<!-- tested: tests/unit/test_docs.py runs this block on inventory/local -->"
QUIET = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run(
        [VENV_BIN / "mkdocs", "build", "--strict", "--site-dir", tmp_path / "site"],
        cwd=REPO, capture_output=True, text=True, env=QUIET, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"`make docs` fails:\n{done.stdout}{done.stderr}"
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_the_generated_reference_pages_are_current(tmp_path):
    done = subprocess.run(
        [sys.executable, REPO / "scripts" / "gen_docs.py", "--out", tmp_path],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    stale = []
    for fresh in sorted(tmp_path.glob("*.md")):
        committed = DOCS / "reference" / fresh.name
        old = committed.read_text().splitlines() if committed.exists() else []
        new = fresh.read_text().splitlines()
        if old != new:
            diff = difflib.unified_diff(
                old, new, f"committed {fresh.name}", "from the code", lineterm="", n=1
            )
            stale.append(f"docs/reference/{fresh.name}:\n" + "\n".join(list(diff)[:30]))
    assert not stale, (
        "the reference pages are out of date with the code: run `make docs-gen` and commit "
        "them\n\n" + "\n\n".join(stale)
    )


def test_the_reference_lists_every_verb_config_key_and_role_variable():
    from trainer import cli
    from trainer.node.config import config_keys

    pages = gen_docs().generate()
    for verb in cli.COMMANDS:
        assert f"## `trainer {verb}`" in pages["cli.md"], verb
    assert "`--max-restarts" in pages["cli.md"] and "`--skip" in pages["cli.md"]
    for key, *_ in config_keys():
        assert f"### `{key}`\n" in pages["config.md"], key
    import yaml

    for spec in (REPO / "roles").glob("*/meta/argument_specs.yml"):
        for name in yaml.safe_load(spec.read_text())["argument_specs"]["main"]["options"]:
            assert f"### `{name}`\n" in pages["roles.md"], f"{spec.parent.parent.name}: {name}"


def test_a_docstring_reads_as_written_on_the_page():
    md_text, table_cell = gen_docs().md_text, gen_docs().table_cell
    # A pipe ends a table cell outside code spans; inside them it is text, and an escape would show.
    assert table_cell("ddp|deepspeed, `--json | jq`") == r"ddp\|deepspeed, `--json | jq`"
    # HTML-looking words would vanish, stars would turn into emphasis; code spans are left as they are.
    assert md_text("goes to <shared>/runs/*_KEY, `<run>/launch` [x]") == (
        r"goes to \<shared\>/runs/\*_KEY, `<run>/launch` \[x\]"
    )


def test_every_preflight_check_has_its_section_with_a_fix():
    from trainer import cli

    _, parser = cli.verb_parser("preflight")
    (skip,) = [a for a in parser._actions if "--skip" in a.option_strings]
    page = (DOCS / "preflight.md").read_text()
    sections = dict(re.findall(r"^### `(\w+)`\n(.*?)(?=^### |\Z)", page, flags=re.M | re.S))
    assert set(skip.choices) <= set(sections), f"undocumented: {sorted(set(skip.choices) - set(sections))}"
    for check in skip.choices:
        assert "\n- " in sections[check], f"{check}: no fix listed"


def test_the_readme_is_a_front_door_whose_links_lead_somewhere():
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    for command in ("make train", "make test", "trainer push -i", "trainer export", "--merge-lora"):
        assert command in text, command
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in [README, *sorted(DOCS.rglob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != RUNNABLE:
                continue
            assert lines[i + 1].strip().startswith("```"), f"{path}: {RUNNABLE} must precede a fenced block"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip().startswith("```"))
            for command in lines[i + 2 : end]:
                command = command.split(" # ")[0].strip()
                if command and not command.startswith("#"):
                    blocks.append((f"{path.relative_to(REPO)}:{i + 3}", command))
    return blocks


def test_some_commands_are_marked_runnable():
    assert len(runnable_blocks()) >= 3


@pytest.mark.parametrize(("where", "command"), runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_a_command_the_docs_show_runs_as_written(where, command):
    """From the checkout, as the docs say: `.venv/bin/trainer ...` is this venv's."""
    argv = shlex.split(command)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = str(VENV_BIN / Path(argv[0]).name)
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{where}: `{command}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
