"""Stage 7: ``report.json`` and a readable summary of what the data pipeline produced.

Reads only what earlier stages wrote (manifests, lang, GMM decode results, alignment info,
drop records, stage timings), so it can be re-run at any time.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from lhotse import CutSet

from local.constants import SPLITS
from local.drops import load_drops

log = logging.getLogger(__name__)

GMM_SYSTEMS = ("mono", "tri", "lda_mllt", "sat")  # lda_mllt: not built with prepare.py --no-lda-mllt


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _split_stats(data_dir: Path) -> dict:
    stats = {}
    for split in SPLITS:
        path = data_dir / "manifests" / f"{split}_cuts.jsonl.gz"
        if not path.exists():
            continue
        cuts = CutSet.from_file(path)
        speakers = {c.supervisions[0].speaker for c in cuts if c.supervisions}
        stats[split] = {
            "utterances": len(cuts),
            "hours": round(sum(c.duration for c in cuts) / 3600, 3),
            "speakers": len(speakers),
        }
    return stats


def _gmm_wers(data_dir: Path) -> dict:
    wers = {}
    for system in GMM_SYSTEMS:
        if system == "lda_mllt" and not (data_dir / "exp" / system).exists():
            continue
        for split in ("dev", "test"):
            res = _read_json(data_dir / "exp" / system / f"decode_{split}" / "wer.json")
            wers[f"{system}_{split}"] = res
    return wers


def _count_phones(lang_dir: Path) -> int | None:
    phones = lang_dir / "phones.txt"
    if not phones.exists():
        return None
    names = [line.split()[0] for line in phones.read_text().splitlines() if line.strip()]
    return sum(1 for n in names if n != "<eps>" and not n.startswith("#"))


def make_report(data_dir: Path, corpus: str = "synthetic") -> dict:
    """Write ``<data_dir>/report.json``, print a summary, and return the report."""
    data_dir = Path(data_dir)
    ali_info = _read_json(data_dir / "ali" / "info.json") or {}
    drops = load_drops(data_dir)
    report = {
        "corpus": corpus,
        "data_dir": str(data_dir),
        "splits": _split_stats(data_dir),
        "num_phones": _count_phones(data_dir / "lang"),
        "num_pdfs": ali_info.get("num_pdfs"),
        "gmm_wer": _gmm_wers(data_dir),
        "phone_agreement": ali_info.get("phone_agreement"),
        "dropped": {
            "total": len(drops),
            "by_reason": dict(Counter(f"{d['stage']}/{d['reason']}" for d in drops)),
            "utterances": drops,
        },
        "stage_seconds": _read_json(data_dir / "stage_seconds.json"),
        "stage_cpu_seconds": _read_json(data_dir / "stage_cpu_seconds.json"),
        "lang": _read_json(data_dir / "lang" / "summary.json"),
        "alignment": ali_info,
        "adaptation": _read_json(data_dir / "adapt" / "info.json"),
        "adaptation_sat": _read_json(data_dir / "adapt" / "sat_info.json"),
    }
    (data_dir / "report.json").write_text(json.dumps(report, indent=1))
    print(format_summary(report))
    return {"report": str(data_dir / "report.json"), "dropped": len(drops)}


def _wer_text(res) -> str:
    return "missing" if not res else f"{res['wer']:.2f} %"  # decode.score gives percent


def format_summary(report: dict) -> str:
    lines = [f"== data pipeline report: {report['data_dir']} ({report['corpus']}) =="]
    for split, s in report["splits"].items():
        lines.append(f"  {split:5s} {s['utterances']:6d} utts {s['hours']:7.3f} h {s['speakers']:4d} speakers")
    ali = report.get("alignment") or {}
    lines.append(f"  phones {report['num_phones']}, pdfs {report['num_pdfs']} (DNN targets: "
                 f"{ali.get('system', 'tri')} alignments{', fMLLR' if ali.get('system') == 'sat' else ''})")
    w = report["gmm_wer"]
    for system in (s for s in GMM_SYSTEMS if f"{s}_dev" in w):
        adapted = " (fMLLR)" if system == "sat" else ""
        lines.append(
            f"  {system:4s} GMM WER{adapted}: dev {_wer_text(w[f'{system}_dev'])}, test {_wer_text(w[f'{system}_test'])}"
        )
    agree = report["phone_agreement"]
    if agree:
        overall = agree.get("overall", agree) if isinstance(agree, dict) else agree
        lines.append(f"  phone agreement with TTS gold timings: {overall}")
    else:
        lines.append("  phone agreement with TTS gold timings: n/a (corpus has no gold timings)")
    adapt = report.get("adaptation")
    if adapt:
        gains = ", ".join(f"{k} {v['gain_per_frame']}" for k, v in adapt["splits"].items())
        lines.append(f"  fbank fMLLR (UBM of {adapt['num_gauss']} Gaussians): log-likelihood gain per frame {gains}")
    adapt_sat = report.get("adaptation_sat")
    if adapt_sat:
        gains = ", ".join(f"{k} {v['gain_per_frame']}" for k, v in adapt_sat["splits"].items())
        lines.append(f"  fbank fMLLR (per-pdf Gaussians, SAT alignments / decoding): log-likelihood gain per frame {gains}")
    d = report["dropped"]
    lines.append(f"  dropped utterances: {d['total']} {d['by_reason'] if d['total'] else ''}")
    if report["stage_seconds"]:
        lines.append("  stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["stage_seconds"].items()))
    if report.get("stage_cpu_seconds"):
        lines.append("  stage CPU seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["stage_cpu_seconds"].items()))
    return "\n".join(lines)
