"""One place for text from a node in a message with markup (live.node_text), and a view that never
raises on a message: a stray `[/red]` from a node raised rich's MarkupError on the start-failure path,
before the launcher stopped the started nodes."""

from __future__ import annotations

import io

from rich.console import Console

from trainer.controller.launcher.live import LiveView, node_text

HOSTILE = (
    "/tmp/build.lock [/red] [link=https://evil.example/]here[/link] \x1b]8;;https://evil.example/\x1b\\x"
)


def shown(text: str, terminal: bool) -> str:
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=terminal, width=300)) as view:
        view.message(text)
    return out.getvalue()


def test_node_text_in_a_message_shows_as_typed_without_links_or_escapes():
    for terminal in (True, False):
        out = shown(f"[red]could not start on node1[/red]: {node_text(HOSTILE)}", terminal)
        assert "[/red] [link=https://evil.example/]here[/link] \\x1b]8;;https://evil.example/" in out, out
        assert "\x1b]8;;https://evil.example" not in out  # no terminal hyperlink, the node's or rich's


def test_a_message_whose_markup_does_not_parse_is_printed_not_raised():
    out = shown(f"could not start on node1: {HOSTILE}", terminal=False)
    assert "could not start on node1: /tmp/build.lock [/red]" in out and "\x1b" not in out, out
