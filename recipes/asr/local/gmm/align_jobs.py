"""Viterbi re-alignment of the training utterances in parallel processes (Kaldi's ``--nj``).

A GMM stage re-aligns its whole training set several times (monophone: 17 of 25 passes); alone in one
process that was about 80 % of the monophone stage's time on the default corpus. ``AlignJobs`` starts
``ALIGN_JOBS`` spawned processes once per stage; each compiles the training graphs of its share of the
utterances (dealt round-robin) and keeps them with their features, so a re-alignment sends only the
current model, and the features again when the stage changed them (SAT's fMLLR). Every utterance is
aligned by its own decoder (``common.viterbi_align``), so the alignments are those of one process.

Used through ``align_jobs(graphs, system, utts)``, which attaches the pool to the stage's training
graphs; ``common.realign_all`` then aligns through it.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

ALIGN_JOBS = 2  # processes per stage: the 2 cores of the reference machine, as the decodings' DECODE_JOBS
MIN_PER_JOB = 100  # utterances per process below which a stage aligns in its own process


class TrainingGraphs(dict):
    """``{utt_id: training graph}`` (``common.compile_graphs``), with what compiled them: the lang dir and
    each utterance's word ids, so that other processes can compile the same graphs. ``jobs``: the
    ``AlignJobs`` attached by :func:`align_jobs`, or None."""

    def __init__(self, graphs: dict, lang_dir: Path | str, word_ids: dict[str, list[int]]) -> None:
        super().__init__(graphs)
        self.lang_dir, self.word_ids, self.jobs = str(lang_dir), word_ids, None


def _worker(conn, lang_dir: str, model: bytes, word_ids: dict[str, list[int]], feats: dict[str, np.ndarray]) -> None:
    """One process: compile its utterances' graphs, then align on request until told to stop."""
    from local.atomic import die_with_parent
    from local.gmm.common import GmmSystem, viterbi_align
    from local.graph.hclg import training_graph_compiler

    die_with_parent()  # a killed stage's workers stop with it
    tm, am, tree = pickle.loads(model)
    compiler = training_graph_compiler(lang_dir, tree, tm)
    graphs = {u: compiler.compile_graph_from_text(ids) for u, ids in word_ids.items()}
    conn.send(len(graphs))
    while (msg := conn.recv()) is not None:
        models, ids, new_feats, beam, retry_beam = msg
        feats.update(new_feats)
        tm, am = pickle.loads(models)
        system = GmmSystem(tm, am, tree)
        conn.send({u: viterbi_align(system, graphs[u], feats[u], u, beam=beam, retry_beam=retry_beam)[0]
                   for u in ids})


class AlignJobs:
    """``num_jobs`` processes that each hold the training graphs and features of a share of ``utts``."""

    def __init__(self, graphs: TrainingGraphs, system, feats: dict[str, np.ndarray], num_jobs: int = ALIGN_JOBS):
        ids = list(graphs)
        self.share = {u: i % num_jobs for i, u in enumerate(ids)}
        self.changed = False
        ctx = multiprocessing.get_context("spawn")  # a forked child would inherit OpenMP state (DESIGN section 7)
        model = pickle.dumps((system.tm, system.am, system.tree))
        self.conns, self.procs = [], []
        t0 = time.time()
        for j in range(num_jobs):
            mine = ids[j::num_jobs]
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, daemon=True,
                               args=(child, graphs.lang_dir, model, {u: graphs.word_ids[u] for u in mine},
                                     {u: feats[u] for u in mine}))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            self._recv(conn)
        log.info("%d alignment processes compiled %d training graphs in %.1f s", num_jobs, len(ids), time.time() - t0)

    def features_changed(self) -> None:
        """The stage replaced features (SAT's fMLLR): the next alignment sends them again."""
        self.changed = True

    def align(self, system, ids: list[str], feats: dict[str, np.ndarray], beam: float,
              retry_beam: float) -> dict[str, np.ndarray | None]:
        """Transition-ids per utterance of ``ids`` (None: no path even at ``retry_beam``), in the order of
        ``ids``; ``feats`` are sent only after :meth:`features_changed`."""
        models = pickle.dumps((system.tm, system.am))
        parts: list[list[str]] = [[] for _ in self.conns]
        for u in ids:
            parts[self.share[u]].append(u)
        for conn, part in zip(self.conns, parts):
            new = {u: feats[u] for u in part} if self.changed else {}
            conn.send((models, part, new, beam, retry_beam))
        self.changed = False
        out: dict = {}
        for conn in self.conns:
            out.update(self._recv(conn))
        return {u: out[u] for u in ids}

    def _recv(self, conn):
        try:
            return conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError("a GMM alignment process died (out of memory?); run the stage again, or align in one "
                               "process with local.gmm.align_jobs.ALIGN_JOBS = 1") from None

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []


@contextmanager
def align_jobs(graphs: TrainingGraphs, system, feats: dict[str, np.ndarray], num_jobs: int | None = None):
    """Within the block, ``realign_all`` on ``graphs`` aligns in ``num_jobs`` processes (default
    ``ALIGN_JOBS``, read at the call; in this process when there are fewer than ``MIN_PER_JOB`` utterances
    per process)."""
    num_jobs = ALIGN_JOBS if num_jobs is None else num_jobs
    if num_jobs < 2 or len(graphs) < MIN_PER_JOB * num_jobs:
        yield graphs
        return
    graphs.jobs = AlignJobs(graphs, system, feats, num_jobs)
    try:
        yield graphs
    finally:
        graphs.jobs.close()
        graphs.jobs = None
