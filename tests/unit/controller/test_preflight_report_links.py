"""The preflight report's bandwidth heatmap never writes through a link planted in the report's dir.

The report may be written into a dir another account can write (the shared dir, a run dir copied with
its links). That account plants a link under the heatmap's temporary name, pointing at a file of the
operator's; the operator's `trainer preflight --report` then must leave that file alone."""

from __future__ import annotations

import os

from trainer.controller.preflight.report import Report, heatmap_path

BANDWIDTH = {"nodes": ["head", "worker"], "matrix": [[None, 9.4], [9.1, None]]}


def test_a_link_planted_under_the_heatmaps_temporary_name_is_not_written_through(tmp_path):
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA operator\n")
    reports = tmp_path / "shared"
    reports.mkdir()
    report_path = reports / "preflight.json"
    picture = heatmap_path(report_path)
    planted = picture.with_name(f".{picture.name}.tmp")
    os.symlink(victim, planted)  # the other account's step

    report = Report(inventory="inventory.yml", bandwidth=dict(BANDWIDTH))
    report.write(report_path)

    assert victim.read_text() == "ssh-ed25519 AAAA operator\n", "the heatmap was written through the link"
    assert picture.read_bytes().startswith(b"\x89PNG"), "no heatmap beside the report"
    assert not picture.is_symlink()
    assert report.bandwidth["heatmap"] == picture.name
