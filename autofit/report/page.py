"""``report.html``: one self-contained page of a search (pictures embedded as data URIs, no network).

The page is built from what the other reports already say, so it cannot disagree with them:
``summary.md`` (rendered from its small Markdown subset: headings, bullet lists, tables,
inline code), the best config's exports (:mod:`autofit.report.exports`), and the PNGs of
:mod:`autofit.report.pictures`. Order: the summary, the best config with its exports, the pictures,
then the tables.
"""

from __future__ import annotations

import base64
import html
import re

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
table { border-collapse: collapse; font-size: .85em; margin: .5em 0 1em; }
th, td { border: 1px solid #ccc; padding: .25em .5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: .88em; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; white-space: pre-wrap; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0 1.5em; }
details { margin: .4em 0; } summary { cursor: pointer; font-weight: 600; }
"""

PICTURE_CAPTIONS = {
    "throughput_vs_peak": "Throughput against peak memory: every real trial, the budget, the best config "
                          "(starred on the sample it is ranked by), and, hollow, the configs the estimate pruned (never ran) "
                          "at their estimate, by why they were pruned",
    "predicted_vs_measured": "Predicted against measured peak memory and step time, every real trial",
    "memory_breakdown": "Memory at the peak of the top configs, predicted beside measured",
    "best_so_far": "Best throughput so far against wall time",
}
_INLINE_CODE = re.compile(r"`([^`]+)`")


def _inline(text: str) -> str:
    return _INLINE_CODE.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text, quote=False))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def markdown_to_html(text: str) -> str:
    """The Markdown subset autofit writes: ``#`` headings, ``-`` lists, ``|`` tables, paragraphs, inline code."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{_inline(lines[i][2:])}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            head, body = _cells(rows[0]), [r for r in rows[1:] if not re.fullmatch(r"\|[-|: ]+\|?", r.strip())]
            out.append("<table><thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr></thead><tbody>"
                       + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in _cells(r)) + "</tr>" for r in body)
                       + "</tbody></table>")
            continue
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
        i += 1
    return "\n".join(out)


def _sections(summary_md: str) -> tuple[str, str, str]:
    """(the summary before the best config, the best config section and what would fit, the rest)."""
    parts = re.split(r"(?m)^(?=## )", summary_md)
    first = ("## Best config", "## What would fit")  # the answer, or what would fit when there is none
    best = "".join(p for p in parts[1:] if p.startswith(first))
    return parts[0], best, "".join(p for p in parts[1:] if not p.startswith(first))


def _exports_html(exports: dict[str, str]) -> str:
    if not exports:
        return ""
    blocks = [f"<details{' open' if i == 0 else ''}><summary>{html.escape(target)}</summary>"
              f"<pre>{html.escape(text)}</pre></details>" for i, (target, text) in enumerate(exports.items())]
    return ("<h3>The best config in your trainer</h3><p>The same as <code>autofit export DIR --to TARGET</code>; "
            "what a target cannot say exactly is in its comment, and an export that changes the global batch, the "
            "precision or the optimizer says so first.</p>" + "".join(blocks))


def _pictures_html(pictures: dict[str, bytes]) -> str:
    out = ["<h2>Pictures</h2>"]
    for name, png in pictures.items():
        data = base64.b64encode(png).decode("ascii")
        caption = PICTURE_CAPTIONS.get(name, name)
        out.append(f"<figure><img alt=\"{html.escape(caption)}\" src=\"data:image/png;base64,{data}\">"
                   f"<figcaption>{html.escape(caption)} (<code>{name}.png</code>)</figcaption></figure>")
    return "\n".join(out)


def page(title: str, summary_md: str, pictures: dict[str, bytes], exports: dict[str, str]) -> str:
    """The whole page as one string: no external reference (styles inline, images as data URIs)."""
    head, best, rest = _sections(summary_md)
    body = [markdown_to_html(head), markdown_to_html(best), _exports_html(exports), _pictures_html(pictures),
            markdown_to_html(rest)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def best_exports(config, settings, profile=None) -> dict[str, str]:
    """The best config in every target's form (torchrun only for a pipeline split); a target that
    fails to export says why in place of its text. ``profile``: the study's (its peaks need no
    profiling when it holds every precision)."""
    from autofit.core.config import Precision
    from autofit.core.errors import AutofitError
    from autofit.estimator.memory_model import needs_selective
    from autofit.report.exports import TARGETS, export, profile_covers
    from autofit.workloads.load import load_workload

    workload = settings.get("workload_source")
    device = settings.get("device_type")
    if not profile_covers(profile, list(Precision), config.device_split > 1, device,
                          selective=needs_selective([config])):
        try:  # loaded once for every target (each export would load and key it again)
            workload = load_workload(workload) if workload else None
        except Exception:  # noqa: BLE001 -- each export below then says why it has no peaks
            pass
    out = {}
    for target in TARGETS:
        if target == "torchrun" and (config.device_split < 2 or config.split_mode.value != "pipeline"):
            continue
        try:
            out[target] = export(config, target, workload=workload, budget=settings.get("budget_bytes"),
                                 device=device, profile=profile).text
        except AutofitError as exc:
            out[target] = f"(not exported: {exc})"
        except Exception as exc:  # noqa: BLE001 -- the user's workload runs here; a finished search keeps its page
            out[target] = f"(not exported: {type(exc).__name__}: {exc})"
    return out


def write_page(study, table, summary_md: str, out_dir) -> dict:
    """Write the pictures (``<name>.png``) and ``report.html`` of ``study`` (a StudySnapshot) to ``out_dir``."""
    from pathlib import Path

    from autofit.core.files import write_atomic
    from autofit.core.records import best_of
    from autofit.profiling.cache import study_profile
    from autofit.report import pictures
    from autofit.report.tables import calibration_of, top_configs

    best = best_of(list(study.records))
    settings = study.settings
    devices = int(settings.get("devices") or 1)
    calibration = calibration_of(study)
    pngs = pictures.render(table, pictures.breakdowns_of(study.records), settings.get("budget_bytes") or 0,
                           best.number if best else None, study.study_name,
                           estimates=pictures.estimates_of(study.records, calibration, devices), devices=devices,
                           calibrated_on=calibration.n_trials,
                           top=[int(n) for n in top_configs(study, table)["number"]])
    paths = pictures.write(pngs, out_dir)
    exports = best_exports(best.config, settings, study_profile(study)) if best else {}
    paths["report.html"] = Path(out_dir) / "report.html"
    write_atomic(paths["report.html"], page(f"autofit: {study.study_name}", summary_md, pngs, exports))
    return paths

