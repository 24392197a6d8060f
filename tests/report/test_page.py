"""report.html from its parts: summary.md's Markdown subset, exports and pictures, escaped and in order."""

from __future__ import annotations

from autofit.report.page import markdown_to_html, page

SUMMARY = """# Search summary: <b>study</b>

- workload: `net<script>` & co

## Best config

No trial ran ok under the budget.

## What would fit

- fits on one device: bf16 with checkpoint_every=1

## Top 10 configs

| trial | config |
|---|---|
| 3 | `fp32 mb=8` |
"""


def test_markdown_subset_and_escaping():
    out = markdown_to_html(SUMMARY)
    assert "<h1>Search summary: &lt;b&gt;study&lt;/b&gt;</h1>" in out
    assert "<li>workload: <code>net&lt;script&gt;</code> &amp; co</li>" in out
    assert "<table><thead><tr><th>trial</th><th>config</th></tr></thead><tbody><tr><td>3</td>" in out
    assert "---" not in out and "<script>" not in out


def test_page_order_exports_escaped_and_pictures_embedded():
    html = page("t", SUMMARY, {"best_so_far": b"\x89PNG fake"}, {"accelerate": "# note <x>\nmixed_precision: \"bf16\"\n"})
    order = [html.index(s) for s in ("<h1>", "What would fit", "the best config in your trainer".capitalize(),
                                      "<h2>Pictures</h2>", "Top 10 configs")]
    assert order == sorted(order)
    assert "# note &lt;x&gt;" in html and 'src="data:image/png;base64,iVBORyBmYWtl"' in html
