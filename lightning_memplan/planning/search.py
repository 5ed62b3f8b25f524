"""The best-first search behind :func:`~lightning_memplan.planning.plan` (see that module's docstring
for the algorithm and the pruning rules); ``_Search`` also serves the nothing-fits suggestions."""

from __future__ import annotations

import heapq
import math
import time
from typing import Any

from lightning_memplan.model import terms
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.offload import host_need_bytes
from lightning_memplan.model.reserved import ReservedEstimate
from lightning_memplan.model.result import MemoryEstimate, readable_bytes
from lightning_memplan.model.sizes import kernels_of
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.planning.budget import Budget, device_need, memory_budget, need_text
from lightning_memplan.planning.decision import Candidate, Rejection
from lightning_memplan.planning.ranking import (
    CHANGE_COST,
    CHANGE_PENALTY,
    SIMPLICITY_MARGIN,
    parallel_axes,
    ranking_factor,
)
from lightning_memplan.planning.space import LayoutChoice, enumerate_layouts
from lightning_memplan.planning.timing import LayoutTimes, StepTimeModel, topology_notes

__all__ = ["CHANGE_COST", "CHANGE_PENALTY", "DEFAULT_TOP_K", "SIMPLICITY_MARGIN", "parallel_axes", "ranking_factor"]

GiB = 2**30
#: Candidates kept (ranked) per decision.
DEFAULT_TOP_K = 5


def _layout_cost(lc: LayoutChoice, user_b: int) -> float:
    cost = 0.0
    if lc.tp > 1:
        cost += CHANGE_COST["tp"]
    if lc.pp > 1:
        cost += CHANGE_COST["pp"] + CHANGE_COST.get(lc.schedule, 0.0)
    if lc.cp > 1:
        cost += CHANGE_COST["cp"]
    if lc.b != user_b:
        cost += CHANGE_COST["micro_batch"]
    return cost


def _option_cost(z: int, sp: bool, rc: str, loss: str, user_loss: str) -> float:
    cost = CHANGE_COST[f"zero{z}"] if z else 0.0
    cost += CHANGE_COST["sp"] if sp else 0.0
    cost += CHANGE_COST.get(rc, 0.0)
    if loss != user_loss:
        cost += CHANGE_COST.get(loss, 0.5)
    return cost


class _Search:
    """One planning run (state shared by the search, the suggestions and the explanation)."""

    def __init__(self, model, train, hardware, allow, global_batch, headroom, explicit_budget, calibration, top_k,
                 *, margin: float = SIMPLICITY_MARGIN, share: _Search | None = None,
                 expandable_segments: bool = False, min_axes: int = 0, cutoff: float = math.inf,
                 host_budget: int | None = None) -> None:
        self.model, self.train, self.hardware = model, train, hardware
        # host bytes one rank may hold (planning/offload.py): checked only where the train offloads
        self.host_budget = host_budget
        self.margin = margin
        # search only layouts with at least ``min_axes`` parallel dimensions (tp, pp, cp) and only
        # scores below ``cutoff`` (known.fastest_plan_note: what can beat the choice without the margin)
        self.min_axes, self.cutoff = min_axes, cutoff
        self.expandable_segments = expandable_segments
        self.allow, self.global_batch = allow, global_batch
        self.headroom, self.explicit_budget = headroom, explicit_budget
        self.calibration, self.top_k = calibration, top_k
        self._cache: dict[tuple, tuple[MemoryEstimate, bool]] = {}
        self._plans: dict[tuple, ParallelPlan] = {}
        self._trains: dict[tuple, TrainSpec] = {}
        self.evaluations = 0
        self._share = share
        self._enumerated: tuple | None = None
        # the time model, its layout prices, compute-only lower bounds and each expanded layout's option
        # combinations by score without the axes factor (shared with the sub-searches it covers)
        self._priced: tuple[StepTimeModel, dict[tuple, LayoutTimes], dict[tuple, float], dict[tuple, list]] | None = None
        # combinations that do not fit (facts about the model and budget, whatever allow= searched)
        self.failures: dict[tuple[int, int, int, int], list[tuple]] = {}
        self._misses: dict[tuple, tuple[MemoryEstimate, Budget]] = {}
        self._without_pools: dict[tuple, bool] = {}  # _fails_without_pools, per recorded failure
        # memo of budget(plan) and need(plan, train, est) (the fit test asks both several times per
        # combination; the sub-searches of the explanation ask them again)
        self._budgets: dict[ParallelPlan, Budget] = {}
        self._needs: dict[tuple, tuple[MemoryEstimate, ReservedEstimate]] = {}
        if share is not None:  # a sub-search on the same model, TrainSpec, cluster and budget: reuse its estimates
            if (share.model, share.train, share.hardware, share.headroom, share.explicit_budget, share.calibration,
                    share.expandable_segments) != (
                    model, train, hardware, headroom, explicit_budget, calibration, expandable_segments):
                raise ValueError("share= must be a search of the same model, train, hardware and budget")
            self._cache, self._plans, self._trains = share._cache, share._plans, share._trains
            self.failures, self._misses, self._without_pools = share.failures, share._misses, share._without_pools
            self._budgets, self._needs = share._budgets, share._needs

    # -- memory ------------------------------------------------------------------------------------
    def materialise(self, lc: LayoutChoice, rc: str, z: int, loss: str, sp: bool) -> tuple[ParallelPlan, TrainSpec]:
        pp = lc.pp > 1
        pkey = (lc.dp, lc.tp, lc.pp, lc.cp, sp, z, lc.m if pp else 1, lc.schedule if pp else "1f1b", lc.v if pp else 1)
        plan = self._plans.get(pkey)
        if plan is None:
            plan = self._plans[pkey] = ParallelPlan(
                lc.dp, lc.tp, lc.pp, lc.cp, sp=sp, zero=z, microbatches=pkey[6], schedule=pkey[7], virtual_stages=pkey[8]
            )
        tkey = (lc.b, 1 if pp else lc.m, rc, loss, lc.cp if loss == "chunked" else 0)
        train = self._trains.get(tkey)
        if train is None:
            chunk = self.train.loss_chunk_size
            if loss == "chunked" and chunk is None:
                chunk = terms.planned_loss_chunk_tokens(self.model, kernels_of(self.train),
                                                        lc.b * self.train.seq_len // lc.cp)
            train = self._trains[tkey] = self.train.replace(
                micro_batch=lc.b, grad_accumulation=tkey[1], recompute=rc, loss=loss, loss_chunk_size=chunk
            )
        return plan, train

    def worst(self, plan: ParallelPlan, train: TrainSpec, *, quick: bool = False) -> MemoryEstimate:
        """Worst-rank estimate from stage 0 and the last stage (see the module docstring).

        ``quick``: when stage 0 alone misses the budget, return it without estimating the last stage
        (enough to prove a miss; its ``stage`` says which rank was checked)."""
        key = (plan, train)
        hit = self._cache.get(key)
        # A quick (stage-0-only) answer is reused only by another quick call; a full call finishes it.
        if hit is not None and (quick or hit[1]):
            return hit[0]
        if hit is None:
            self.evaluations += 1
            est = estimate_memory(self.model, train, plan, rank=0, calibration=self.calibration)
        else:
            est = hit[0]
        full = plan.pp == 1 or not quick or self.fits(plan, train, est)
        if plan.pp > 1 and full:
            per_stage = plan.dp * plan.cp * plan.tp
            for stage in _candidate_stages(plan, self.model.n_layers, train.framework):
                other = estimate_memory(self.model, train, plan, rank=stage * per_stage, calibration=self.calibration)
                if other.total > est.total:
                    est = other
        self._cache[key] = (est, full)
        return est

    def budget(self, plan: ParallelPlan) -> Budget:
        bud = self._budgets.get(plan)
        if bud is None:
            bud = self._budgets[plan] = memory_budget(self.hardware, plan, headroom=self.headroom,
                                                      explicit=self.explicit_budget)
        return bud

    def need(self, plan: ParallelPlan, train: TrainSpec, est: MemoryEstimate) -> ReservedEstimate:
        """What ``est`` needs of the device (``planning.budget.device_need``: reserved on CUDA)."""
        hit = self._needs.get((plan, train))
        if hit is not None and hit[0] is est:
            return hit[1]
        need = device_need(self.model, train, plan, est, self.hardware, expandable_segments=self.expandable_segments)
        self._needs[(plan, train)] = (est, need)
        return need

    def fits(self, plan: ParallelPlan, train: TrainSpec, est: MemoryEstimate) -> bool:
        """The fit test: the modelled reserved peak (allocated on CPU) <= the plan's budget, and, for a
        search with a host budget (offloading, ``planning/offload.py``), the rank's host need within it."""
        return self.device_fits(plan, train, est) and self.host_fits(est)

    def device_fits(self, plan: ParallelPlan, train: TrainSpec, est: MemoryEstimate) -> bool:
        """The device half of :meth:`fits`."""
        return self.need(plan, train, est).reserved <= self.budget(plan).budget

    def host_fits(self, est: MemoryEstimate) -> bool:
        """Whether ``est``'s host need (pinned blocks at their rounding bound) fits the host budget."""
        return self.host_budget is None or not est.host or host_need_bytes(est) <= self.host_budget

    def ratio(self, plan: ParallelPlan, train: TrainSpec, est: MemoryEstimate) -> float:
        """Need / budget (the closest miss has the smallest)."""
        return self.need(plan, train, est).reserved / self.budget(plan).budget

    def miss_reason(self, plan: ParallelPlan, train: TrainSpec, est: MemoryEstimate,
                    need: ReservedEstimate | None = None) -> str:
        largest = est.largest_component()
        need = need if need is not None else self.need(plan, train, est)
        if self.device_fits(plan, train, est) and not self.host_fits(est):
            return (f"stage {est.stage} fits the device ({need_text(need)}) but needs {readable_bytes(host_need_bytes(est))} "
                    f"of host memory > {readable_bytes(self.host_budget or 0)} host budget per rank")
        return (
            f"stage {est.stage} needs {need_text(need)} > "
            f"{readable_bytes(self.budget(plan).budget)} budget "
            f"(largest: {largest} {readable_bytes(getattr(est, largest))}, {est.peak_phase} peak)"
        )

    def memory_rejection(self, layout: str, plan: ParallelPlan, train: TrainSpec, est: MemoryEstimate,
                         prefix: str = "") -> Rejection:
        """The :class:`Rejection` of a combination whose need exceeds its budget."""
        need = self.need(plan, train, est)
        return Rejection(layout=layout, kind="memory", reason=prefix + self.miss_reason(plan, train, est, need),
                         peak_bytes=est.total, reserved_bytes=need.reserved,
                         budget_bytes=self.budget(plan).budget)

    # -- search ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """The best-first search (module docstring of ``planning/planner.py``): ``{"candidates",
        "rejected", "closest", "best", "stats"}``."""
        t0 = time.perf_counter()
        layouts, early = self._layouts()
        rejected = [Rejection(layout=w, kind=k, reason=r) for w, k, r in early]
        if not layouts:
            self._raise_no_layout(self.hardware.world_size, early)
        run = _Run(self, layouts, tuple(self.allow.recompute))
        t_enum = time.perf_counter() - t0
        self._bounds_done: set[tuple] = set()
        self._closest: tuple | None = None
        while run.heap and len(run.candidates) < self.top_k:
            score, i, k = heapq.heappop(run.heap)
            if score >= self.cutoff:  # every later entry scores at least as much
                heapq.heappush(run.heap, (score, i, k))
                break
            if i in run.done:
                continue
            if k == -2:  # price it, re-queue with the full bound
                self._queue_priced(run, i)
            elif k == -1:  # first visit: check the most memory-saving options, then expand
                self._expand(run, i, rejected)
            else:
                self._try_option(run, i, k, score, rejected)
        self._report_unvisited(run, rejected)
        stats = {
            "world_size": self.hardware.world_size, "layouts": len(layouts), "layouts_priced": len(run.times),
            "memory_evaluations": self.evaluations, "enumerate_s": t_enum,
        }
        if not run.candidates and self._closest is None and self._share is not None:
            self._closest_from_shared_misses(set(layouts))
        closest = None
        if self._closest is not None:  # price the closest miss (its layout may never have been priced)
            _, est, bud, lc, rc, z, lm, sp = self._closest
            closest = self._candidate(lc, run.price(lc), rc, z, lm, sp, est, bud)
        best = run.candidates[0].step.total_s if run.candidates else None
        return {"candidates": run.candidates, "rejected": rejected, "closest": closest, "best": best, "stats": stats}

    def _layouts(self) -> tuple[list[LayoutChoice], list[tuple[str, str, str]]]:
        """The enumerated layouts and early rejections (a sub-search with the same allow and batch reuses
        its parent's)."""
        share = self._share
        if share is not None and share._enumerated is not None and share._enumerated[0] == (self.allow, self.global_batch):
            layouts, early = share._enumerated[1]
        else:
            layouts, early = enumerate_layouts(self.model, self.train, self.hardware.world_size, self.allow,
                                               self.global_batch)
        self._enumerated = ((self.allow, self.global_batch), (layouts, early))
        return layouts, early

    def _time_model(self, recomputes: tuple[str, ...], zeros: tuple[int, ...], losses: tuple[str, ...]) -> tuple:
        """``(time model, prices, lower bounds, expanded options)``, a parent search's when it covers these
        options (its prices serve), else new ones."""
        share = self._share
        if share is not None and share._priced is not None and _covers(share._priced[0], recomputes, zeros, losses):
            priced = share._priced
        else:
            tm = StepTimeModel(self.model, self.train, self.hardware, recomputes=recomputes, zeros=zeros, losses=losses)
            priced = (tm, {}, {}, {})
        self._priced = priced
        return priced

    def _queue_priced(self, run: _Run, i: int) -> None:
        """Price layout ``i`` and re-queue it with its full bound: the least slot time over the options, the
        least exposed data-parallel time and optimizer step."""
        lc = run.layouts[i]
        recomputes = run.recomputes
        lt = run.lts[i] = run.price(lc)
        slot = min(lt.compute_mb[r] + lt.tp_mb[r] for r in recomputes) + lt.cp_mb + lt.pp_mb
        slot += min(lt.loss_mb[lm] for lm in lc.losses)
        bound = lt.slots * slot + min(lt.dp_exposed[(z, r)] for z in lc.zeros for r in recomputes)
        bound += min(lt.opt_s[z] for z in lc.zeros)
        heapq.heappush(run.heap, (bound / lt.tokens * run.factor(lc, _layout_cost(lc, self.train.micro_batch)), i, -1))

    def _expand(self, run: _Run, i: int, rejected: list[Rejection]) -> None:
        """First visit of a priced layout: its family's and its own most memory-saving options must fit;
        then its option combinations, ranked without the axes factor, are queued from the best."""
        lc, lt = run.layouts[i], run.lts[i]
        if lt is None:  # k >= -1 is only queued after the k == -2 visit priced the layout
            raise RuntimeError(f"layout {lc.describe()} reached option expansion before being priced")
        fam = (lc.dp, lc.tp, lc.pp, lc.cp)
        if fam not in self.failures:
            self.failures[fam] = []
            j = run.first_in_family.get(fam)
            if j is not None and j != i:  # the family's smallest micro-batch bounds them all
                self._max_saving_check(run.layouts[j], run.recomputes)
        verdict = self._max_saving_check(lc, run.recomputes)
        if verdict is not None:
            run.done.add(i)
            rejected.append(verdict)
            return
        opts = run.expanded.get((lc, run.recomputes))
        if opts is None:  # ranked without the axes factor, the same for every combination of lc
            base = _layout_cost(lc, self.train.micro_batch)
            opts = [
                (lt.total(rc, z, lm) / lt.tokens * (1.0 + CHANGE_PENALTY * (base + run.ocost[(z, sp, rc, lm)])),
                 rc, z, lm, sp)
                for rc in run.recomputes for z in lc.zeros for lm in lc.losses for sp in lc.sps
            ]
            opts.sort(key=lambda o: o[0])
            run.expanded[(lc, run.recomputes)] = opts
        run.combos[i] = opts
        run.axes_of[i] = run.axes_factor(lc)
        heapq.heappush(run.heap, (opts[0][0] * run.axes_of[i], i, 0))

    def _try_option(self, run: _Run, i: int, k: int, score: float, rejected: list[Rejection]) -> None:
        """The ``k``-th option combination of layout ``i``: pruned by a recorded failure, or estimated; a fit
        is a candidate (the layout is done), a miss is recorded; the next combination is queued."""
        lc, lt = run.layouts[i], run.lts[i]
        assert lt is not None  # combinations are queued only after _expand
        raw, rc, z, lm, sp = run.combos[i][k]
        sc = raw * run.axes_of[i]
        fam = (lc.dp, lc.tp, lc.pp, lc.cp)
        what = f"{lc.describe()} zero={z}{' sp' if sp else ''} recompute={rc} loss={lm}"
        dom = self._bounded_out(lc, rc, z, lm, sp, run.layouts[run.first_in_family.get(fam, i)])
        if dom is not None and dom == (lc, rc, z, lm, sp) and dom in self._misses:
            # this very combination was estimated as a bound and missed: report its numbers
            rejected.append(self.memory_rejection(what, *self.materialise(lc, rc, z, lm, sp), self._misses[dom][0]))
        elif dom is not None:
            run.pruned[i] = run.pruned.get(i, 0) + 1  # reported once per layout
        else:
            plan, tr = self.materialise(lc, rc, z, lm, sp)
            try:
                est = self.worst(plan, tr, quick=True)
            except ValueError as exc:  # a rule of the memory model the enumeration did not know
                run.done.add(i)
                rejected.append(Rejection(layout=lc.describe(), kind="divisibility", reason=str(exc)))
                return
            bud = self.budget(plan)
            if self.fits(plan, tr, est):
                run.candidates.append(self._candidate(lc, lt, rc, z, lm, sp, est, bud, score=sc))
                run.done.add(i)
                return
            self._record_miss(lc, rc, z, lm, sp, est, bud)
            rejected.append(self.memory_rejection(what, plan, tr, est))
        if k + 1 < len(run.combos[i]):
            heapq.heappush(run.heap, (run.combos[i][k + 1][0] * run.axes_of[i], i, k + 1))
        else:
            run.done.add(i)

    def _report_unvisited(self, run: _Run, rejected: list[Rejection]) -> None:
        """The pruned combinations (once per layout), and everything left in the heap, never memory-checked
        (once per (dp, tp, pp, cp), at its best score)."""
        for i, n in run.pruned.items():
            rejected.append(Rejection(layout=run.layouts[i].describe(), kind="memory", reason=(
                f"{n} option combination{'s' if n > 1 else ''} (zero/sp/recompute/loss) need at least as much memory "
                "as a combination shown above that does not fit (more ZeRO, sp or recompute never adds memory)")))
        slower: dict[tuple[int, int, int, int], tuple[float, LayoutChoice]] = {}
        for score, i, _ in run.heap:
            if i in run.done:
                continue
            lc = run.layouts[i]
            fam = (lc.dp, lc.tp, lc.pp, lc.cp)
            if fam not in slower or score < slower[fam][0]:
                slower[fam] = (score, lc)
        candidates = run.candidates
        for score, lc in sorted(slower.values(), key=lambda x: x[0]):
            why = f"ranked below the {len(candidates)} kept candidates (>= {score * 1e6:.4g} us/token"
            why += f" vs {candidates[-1].score * 1e6:.4g})" if candidates else ")"
            notes = topology_notes(self.hardware, lc.dp, lc.tp, lc.pp, lc.cp)
            if notes:
                why += "; " + "; ".join(notes)
            rejected.append(Rejection(layout=f"dp={lc.dp} tp={lc.tp} pp={lc.pp} cp={lc.cp}", kind="slower", reason=why))

    def _candidate(self, lc: LayoutChoice, lt: LayoutTimes, rc: str, z: int, lm: str, sp: bool,
                   est: MemoryEstimate, bud: Budget, *, score: float = 0.0) -> Candidate:
        plan, tr = self.materialise(lc, rc, z, lm, sp)  # cached
        cost = _layout_cost(lc, self.train.micro_batch) + _option_cost(z, sp, rc, lm, self.train.loss)
        return Candidate(plan=plan, train=tr, estimate=est, budget=bud, step=lt.step_time(rc, z, lm),
                         change_cost=cost, score=score, notes=lt.notes, need=self.need(plan, tr, est))

    def _bounded_out(self, lc: LayoutChoice, rc: str, z: int, lm: str, sp: bool, family_first: LayoutChoice) -> tuple | None:
        """Prove ``(lc, options)`` infeasible without estimating it, when possible.

        Checks the bounds that dominate it, cheapest proof first: the same recompute and loss with the
        most ZeRO and sp, at the family's smallest micro-batch (1F1B) and then at ``lc``; then with
        this sp. Each bound is estimated once and its miss recorded, so it also settles every other
        combination it dominates (other micro-batches, schedules and looser options)."""
        dom = self._dominated(lc, rc, z, lm, sp)
        if dom is not None:
            return dom
        zmax, spmax = max(lc.zeros), max(lc.sps)
        targets = [family_first, lc] if family_first is not lc else [lc]
        for level in ((rc, zmax, lm, spmax), (rc, zmax, lm, sp)):
            for target in targets:
                if level == (rc, z, lm, sp) and target is lc:
                    continue  # that is the combination itself
                key = (id(target),) + level
                if key in self._bounds_done:
                    continue
                self._bounds_done.add(key)
                if self._dominated(target, *level) is not None:
                    continue
                try:
                    plan, tr = self.materialise(target, *level)
                    est = self.worst(plan, tr, quick=True)
                except ValueError:
                    continue
                bud = self.budget(plan)
                if not self.fits(plan, tr, est):
                    self._record_miss(target, *level, est, bud)
                    dom = self._dominated(lc, rc, z, lm, sp)
                    if dom is not None:
                        return dom
        return None

    #: Recompute modes by memory saved: "full" saves the most, "none" the least; "selective" (attention
    #: core) and "selective_op" (every second matmul) share a rank and are not compared with each other.
    _RC_RANK = {"none": 0, "selective": 1, "selective_op": 1, "full": 2}
    _LOSS_RANK = {"fp32_upcast": 0, "naive": 1, "vocab_parallel": 2}

    def _record_failure(self, lc: LayoutChoice, rc: str, z: int, lm: str, sp: bool) -> None:
        self.failures.setdefault((lc.dp, lc.tp, lc.pp, lc.cp), []).append((lc, rc, z, lm, sp))

    @staticmethod
    def _failure_text(f: tuple) -> str:
        flc, frc, fz, flm, fsp = f
        return f"{flc.describe()} zero={fz}{' sp' if fsp else ''} recompute={frc} loss={flm}"

    def _dominated(self, lc: LayoutChoice, rc: str, z: int, lm: str, sp: bool) -> tuple | None:
        """A recorded failure that saves at least as much memory in every dimension, or ``None``.

        Orders used (each from the memory model's structure): more ZeRO, sp, and (for stages of more
        than 2 blocks) more recompute never add memory; vocab-parallel <= naive <= fp32_upcast; a
        larger micro-batch holds at least as many activations (b * min(p, m) grows with b) when the
        previous step's gradients are alive in the forward (without a pipeline), or while accumulation
        continues (m > 1), and for the chunked loss only where its auto chunk is not smaller;
        interleaved holds at least the 1F1B in-flight micro-batches (GPipe holds more activations but,
        all forwards before any backward, no gradients in them: it is bounded only by GPipe).

        The reserved bytes add FSDP2's side-stream pools only with FSDP (zero >= 2 over dp x cp > 1), so
        a ZeRO-2/3 failure bounds a ZeRO-0/1 combination only through :meth:`_fails_without_pools`
        (a vocabulary-dominated model can reserve a few % more at zero=2 than at zero=1)."""
        rc_ordered = -(-self.model.n_layers // lc.pp) > 2
        for f, frc, fz, flm, fsp in self.failures.get((lc.dp, lc.tp, lc.pp, lc.cp), ()):
            if f.b > lc.b or fz < z or (sp and not fsp):
                continue
            if f.b < lc.b and not ((self.train.grads_alive_in_forward and lc.pp == 1) or lc.m > 1):
                continue  # (a pipeline stage holds no gradients in its forward at m = 1: model/assemble.py)
            if not (f.schedule == lc.schedule and f.v == lc.v) and not (f.schedule == "1f1b" and f.v == 1
                                                                         and lc.schedule != "gpipe"):
                continue  # GPipe's forwards meet no gradients, 1F1B's do: neither bounds the other
            if flm != lm and not (flm in self._LOSS_RANK and lm in self._LOSS_RANK and self._LOSS_RANK[flm] >= self._LOSS_RANK[lm]):
                continue
            if frc != rc and not (rc_ordered and self._RC_RANK[frc] > self._RC_RANK[rc]):
                continue
            if lm == "chunked" and f.b != lc.b and self._chunk(lc) < self._chunk(f):
                continue  # the auto chunk is not monotone in the tokens: a larger b can hold a smaller working set
            if self._crosses_fsdp(lc, fz, z) and not self._fails_without_pools((f, frc, fz, flm, fsp)):
                continue
            return (f, frc, fz, flm, fsp)
        return None

    def _chunk(self, lc: LayoutChoice) -> int:
        """The chunked loss's tokens per chunk on ``lc`` (the TrainSpec :meth:`materialise` builds, cached)."""
        return self.materialise(lc, "none", 0, "chunked", False)[1].loss_chunk_size or 0

    @staticmethod
    def _crosses_fsdp(lc: LayoutChoice, fz: int, z: int) -> bool:
        """Whether a failure at ZeRO ``fz`` is FSDP (side-stream pools in its reserved bytes) and ``z`` is not."""
        return fz >= 2 > z and lc.dp * lc.cp > 1

    def _fails_without_pools(self, failure: tuple) -> bool:
        """Whether ``failure`` misses its budget even without FSDP2's pools: its allocated bytes plus the
        rounding and loss-segment terms, which every combination with less ZeRO (at least as many
        allocated bytes, ``_dominated``'s orders) and the same or a looser loss also reserves."""
        hit = self._without_pools.get(failure)
        if hit is None:
            est, bud = self._misses[failure]
            need = self.need(*self.materialise(*failure), est)
            hit = self._without_pools[failure] = est.total + need.rounding + need.loss_segment > bud.budget
        return hit

    def _max_saving_opts(self, lc: LayoutChoice, recomputes: tuple[str, ...]) -> list[tuple[str, int, str, bool]]:
        """The most memory-saving combinations of ``lc``: the most ZeRO and sp with the most recompute
        (every recompute mode at <= 2 blocks per stage, where full recompute's rebuilt block may exceed
        less) and each loss no other loss bounds: the most saving of vocab-parallel <= naive <= fp32_upcast
        and the chunked loss, which is ordered with none of them (with tp > 1 the V/t logits can be
        smaller than a chunk's working set; where one chunk holds every token its fp32 working set
        exceeds the naive loss's e-byte logits)."""
        if -(-self.model.n_layers // lc.pp) > 2:
            rcs = [next((r for r in ("full", "selective", "none") if r in recomputes), recomputes[0])]
        else:
            rcs = list(recomputes)
        ranked = [m for m in lc.losses if m in self._LOSS_RANK]
        losses = [m for m in lc.losses if m not in self._LOSS_RANK]  # chunked (and loss_parallel): unordered
        if ranked:
            losses.append(max(ranked, key=self._LOSS_RANK.__getitem__))
        return [(rc, max(lc.zeros), lm, max(lc.sps)) for rc in rcs for lm in losses]

    def _max_saving_check(self, lc: LayoutChoice, recomputes: tuple[str, ...]) -> Rejection | None:
        """``None`` when one of the most memory-saving combinations of ``lc`` (:meth:`_max_saving_opts`)
        fits, else the layout's :class:`Rejection`; a miss is recorded so :meth:`_dominated` prunes what
        it bounds. Where the layout also allows ZeRO-0/1 next to FSDP and the FSDP miss is within
        FSDP2's pools of the budget, the same options at the highest ZeRO below 2 must miss too."""
        first = None
        low = max((x for x in lc.zeros if x <= 1), default=None)
        for rc, z, lm, sp in self._max_saving_opts(lc, recomputes):
            verdict, failure = self._max_saving_one(lc, rc, z, lm, sp)
            if verdict is None or verdict.kind == "divisibility":
                return verdict
            first = first or verdict
            if low is not None and failure is not None and self._crosses_fsdp(lc, failure[2], low) \
                    and not self._fails_without_pools(failure):
                verdict, _ = self._max_saving_one(lc, rc, low, lm, sp)
                if verdict is None or verdict.kind == "divisibility":
                    return verdict
        return first

    def _max_saving_one(self, lc: LayoutChoice, rc: str, z: int, lm: str, sp: bool) -> tuple[Rejection | None, tuple | None]:
        """:meth:`_max_saving_check` for one combination: ``(rejection or None, the failure that proves
        it)``."""
        opts = [f"zero={z}" if z else "", "sp" if sp else "", f"recompute={rc}", f"loss={lm}"]
        prefix = f"even with {', '.join(o for o in opts if o)}: "
        dom = self._dominated(lc, rc, z, lm, sp)
        if dom is not None:
            if dom[0] == lc and dom[1:] == (rc, z, lm, sp):
                # checked already (as its family's bound): report that estimate, not "as much as itself"
                plan, tr = self.materialise(lc, rc, z, lm, sp)
                return self.memory_rejection(lc.describe(), plan, tr, self._misses[dom][0], prefix), dom
            return Rejection(layout=lc.describe(), kind="memory",
                             reason=f"needs at least as much as {self._failure_text(dom)}, which does not fit"), dom
        plan, tr = self.materialise(lc, rc, z, lm, sp)
        try:
            est = self.worst(plan, tr, quick=True)
        except ValueError as exc:  # the memory model rejects this layout outright
            return Rejection(layout=lc.describe(), kind="divisibility", reason=str(exc)), None
        if self.fits(plan, tr, est):
            return None, None
        self._record_miss(lc, rc, z, lm, sp, est, self.budget(plan))
        return self.memory_rejection(lc.describe(), plan, tr, est, prefix), (lc, rc, z, lm, sp)

    def _record_miss(self, lc: LayoutChoice, rc: str, z: int, lm: str, sp: bool, est: MemoryEstimate, bud: Budget) -> None:
        """Record a combination that does not fit (for :meth:`_dominated`) and keep the closest miss:
        the smallest worst-rank need (reserved) / budget ratio, which the decision reports when nothing fits."""
        self._record_failure(lc, rc, z, lm, sp)
        self._misses[(lc, rc, z, lm, sp)] = (est, bud)
        best = self._closest
        plan, tr = self.materialise(lc, rc, z, lm, sp)
        if best is not None and best[0] <= self.ratio(plan, tr, est):
            return  # ``est`` may be a stage-0 lower bound; the full worst rank is only larger
        est = self.worst(plan, tr)
        ratio = self.ratio(plan, tr, est)
        if best is None or ratio < best[0]:
            self._closest = (ratio, est, bud, lc, rc, z, lm, sp)

    def _closest_from_shared_misses(self, layouts: set[LayoutChoice]) -> None:
        """Where a sub-search's misses were all proven by a search it shares failures with, its closest
        plan is the shared miss, among its own layouts, with the smallest worst-rank need / budget."""
        mine = {lc.shape: lc for lc in layouts}
        own = []
        for (flc, rc, z, lm, sp), (est, _bud) in self._misses.items():
            lc = mine.get(flc.shape)
            if lc is not None and z in lc.zeros and sp in lc.sps and lm in lc.losses and rc in self.allow.recompute:
                own.append((self.ratio(*self.materialise(lc, rc, z, lm, sp), est), (lc, rc, z, lm, sp)))
        if own:
            lc, rc, z, lm, sp = min(own, key=lambda x: x[0])[1]
            plan, tr = self.materialise(lc, rc, z, lm, sp)
            est, bud = self.worst(plan, tr), self.budget(plan)
            self._closest = (self.ratio(plan, tr, est), est, bud, lc, rc, z, lm, sp)

    def _raise_no_layout(self, world: int, early: list[tuple[str, str, str]]) -> None:
        kinds = {k for _, k, _ in early}
        sample = "; ".join(r for _, _, r in early[:6])
        if kinds == {"batch"} or (self.global_batch is not None and "batch" in kinds and "divisibility" not in kinds):
            raise ValueError(
                f"global_batch={self.global_batch!r} is not divisible by dp x micro-batch for any layout of "
                f"world size {world} ({sample}); use a global batch that is a multiple of the data-parallel "
                f"size, e.g. {world * self.train.micro_batch}"
            )
        raise ValueError(
            f"world size {world} (gpus_per_node={self.hardware.gpus_per_node} x num_nodes="
            f"{self.hardware.num_nodes}) admits no dp x tp x pp x cp layout under the allowed options: "
            f"{sample or 'every axis is restricted by allow'}; allow data parallelism (it divides any world "
            "size), change allow=, or use a world size that divides the heads/layers/global batch"
        )


class _Run:
    """One search run's state: the layouts, the time model's prices and bounds, the option combinations of
    each expanded layout and the best-first heap of ``(score, layout index, k)`` (``k`` = -2: unpriced,
    ranked by a compute-only bound; -1: priced, ranked by its full bound; >= 0: its k-th combination)."""

    def __init__(self, search: _Search, layouts: list[LayoutChoice], recomputes: tuple[str, ...]) -> None:
        train = search.train
        self.layouts, self.recomputes = layouts, recomputes
        zeros = tuple(sorted({z for lc in layouts for z in lc.zeros}))
        losses = tuple(dict.fromkeys(lm for lc in layouts for lm in lc.losses))
        self.tm, self.times, self.lower, self.expanded = search._time_model(recomputes, zeros, losses)
        self.mult = [ranking_factor(0.0, n, modelled=self.tm.modelled, margin=search.margin) for n in range(4)]
        self.lts: list[LayoutTimes | None] = [None] * len(layouts)
        self.combos: dict[int, list[tuple[float, str, int, str, bool]]] = {}
        self.axes_of: dict[int, float] = {}  # each expanded layout's axes factor
        self.ocost = {(z, sp, rc, lm): _option_cost(z, sp, rc, lm, train.loss)
                      for z in zeros for sp in (False, True) for rc in recomputes for lm in losses}
        self.pruned: dict[int, int] = {}
        self.done: set[int] = set()
        self.candidates: list[Candidate] = []
        # each (dp, tp, pp, cp) family's smallest micro-batch under 1F1B: the bound for all its layouts
        self.first_in_family: dict[tuple[int, int, int, int], int] = {}
        for i, lc in enumerate(layouts):
            if lc.schedule == "1f1b":
                fam = (lc.dp, lc.tp, lc.pp, lc.cp)
                j = self.first_in_family.get(fam)
                if j is None or lc.b < layouts[j].b:
                    self.first_in_family[fam] = i
        # Cheap compute-only bounds first (k = -2); a layout is priced when it reaches the top of the
        # heap and re-queued with its full bound (k = -1), so most layouts are never priced.
        self.heap = [
            (self.lower_bound(lc) / (lc.dp * lc.m * lc.b * train.seq_len) * self.factor(lc, _layout_cost(lc, train.micro_batch)),
             i, -2)
            for i, lc in enumerate(layouts)
            if _axes_count(lc) >= search.min_axes
        ]
        heapq.heapify(self.heap)

    def axes_factor(self, lc: LayoutChoice) -> float:
        """:func:`ranking_factor`'s axes term, tabled."""
        return self.mult[_axes_count(lc)]

    def factor(self, lc: LayoutChoice, cost: float) -> float:
        """:func:`ranking_factor` of ``lc`` at change cost ``cost``."""
        return (1.0 + CHANGE_PENALTY * cost) * self.axes_factor(lc)

    def price(self, lc: LayoutChoice) -> LayoutTimes:
        key = _price_key(lc)
        lt = self.times.get(key)
        if lt is None:  # GPipe and 1F1B share every time term
            lt = self.times[key] = self.tm.layout(lc.shape)
        return lt

    def lower_bound(self, lc: LayoutChoice) -> float:
        key = _price_key(lc)
        lb = self.lower.get(key)
        if lb is None:
            lb = self.lower[key] = self.tm.compute_lower_bound(lc.shape)
        return lb


def _covers(tm: StepTimeModel, recomputes: tuple, zeros: tuple, losses: tuple) -> bool:
    """Whether ``tm``'s layout prices hold every option a search over these sets looks up."""
    return set(recomputes) <= set(tm.recomputes) and set(zeros) <= set(tm.zeros) and set(losses) <= set(tm.losses)


def _axes_count(lc: LayoutChoice) -> int:
    """How many of tp, pp, cp a layout uses (:func:`parallel_axes`, counted)."""
    return (lc.tp > 1) + (lc.pp > 1) + (lc.cp > 1)


def _price_key(lc: LayoutChoice) -> tuple:
    """What a layout's time terms depend on (GPipe and 1F1B share every one)."""
    return (lc.dp, lc.tp, lc.pp, lc.cp, lc.b, lc.m, lc.v, lc.schedule == "interleaved")


def _candidate_stages(plan: ParallelPlan, n_layers: int, framework: str = "torch") -> list[int]:
    """Stages besides 0 that can hold a rank's peak: the last (lm_head and logits), the first stage
    whose in-flight micro-batches number fewer than m, where this step's gradients first meet a full
    in-flight set (the memory model's pipeline timeline), and, where stage 0 holds fewer blocks than
    others (Llama 3's split, :func:`lightning_memplan.model.frameworks.rank_block_counts`), the first
    stage with the most blocks. Later middle stages hold fewer micro-batches and no more blocks, so they
    never exceed these."""
    from lightning_memplan.model.frameworks import rank_block_counts
    from lightning_memplan.model.terms import pipeline_inflight_microbatches

    stages = [plan.pp - 1]
    for stage in range(1, plan.pp - 1):
        inflight = pipeline_inflight_microbatches(stage, plan.pp, plan.microbatches, plan.schedule, plan.virtual_stages)
        if inflight < plan.microbatches:
            stages.insert(0, stage)
            break
    counts = rank_block_counts(n_layers, plan.pp, plan.virtual_stages if plan.schedule == "interleaved" else 1, framework)
    if counts[0] < max(counts):
        busiest = counts.index(max(counts))
        if busiest not in stages:
            stages.insert(0, busiest)
    return stages
