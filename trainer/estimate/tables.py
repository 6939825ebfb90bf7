"""The estimator's tables: every registered policy and every loss head measured on one session (in worker processes
when asked), a policy that cannot run this model mapped to its one-line reason."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from typing import Any

from omegaconf import OmegaConf

from trainer import CONF
from trainer.core.schema import Config
from trainer.estimate.session import Estimate, Session, measure, open_session
from trainer.loss import LOSSES
from trainer.policies import POLICIES, Plan, Policy, PolicyError, build_policy, resolve_plan


def default_policy(name: str) -> Policy:
    """A registered policy with the parameters of its conf/policy/<name>.yaml (the class defaults without one)."""
    path = CONF / "policy" / f"{name}.yaml"
    node = OmegaConf.load(path) if path.is_file() else OmegaConf.create()
    node.pop("defaults", None)  # the yaml extends its Config (`- /policy_schema/<name>`): its own values only
    return build_policy({**OmegaConf.to_container(node), "name": name})  # type: ignore[dict-item]


Task = tuple[str, str | None]  # (policy, loss head; None: the configured one)


def estimate_all(
    config: Config,
    device: str | None = None,
    plans: dict[str, Plan] | None = None,
    autocast_cache: bool = False,
    session: Session | None = None,
    known: Estimate | None = None,
    workers: int = 1,
    only: Collection[str] | None = None,
) -> dict[str, Estimate | str]:
    """Every registered policy (or those in `only`): the configured one with its parameters, the others with their
    conf defaults; `plans` gives a policy's plan (the one a planner chose for `auto`). A policy that cannot run this
    model (e.g. policy.k > n_layer) maps to its one-line reason; `auto` without a plan is left out. `known`: the
    configured policy's estimate, already made. See `estimate_tables` for `workers`."""
    table, _ = estimate_tables(config, device, plans, autocast_cache, session, known, workers, losses=False, only=only)
    return table


def estimate_tables(
    config: Config,
    device: str | None = None,
    plans: dict[str, Plan] | None = None,
    autocast_cache: bool = False,
    session: Session | None = None,
    known: Estimate | None = None,
    workers: int = 1,
    losses: bool = True,
    policies: bool = True,
    first: Callable[[], Estimate] | None = None,
    only: Collection[str] | None = None,
    startup_s: float | None = None,
) -> tuple[dict[str, Estimate | str], dict[str, Estimate | str]]:
    """The policy table (`estimate_all`; with `policies` false, only `known`) and, with `losses`, the configured
    policy under every loss head. `first` makes the configured policy's estimate in this process, first (its time
    decides whether a worker is worth starting); it stands for `known`. `only`: these policies, no others.

    A policy whose plan runs as one already measured (selective under fused attention, offload without a device to
    offload from: both `none`) takes that estimate under its own name. `workers` > 1 measures part of the work in
    other processes, each with a session of its own: the fake run is Python-bound, so on 2 cores the tables of a 7B
    model take about half the time. A worker is started only once one step has been timed here and the steps left
    are worth its start-up (`startup_s`, by default this process's CPU time at its first table: a worker repeats its
    imports and its session), so a small model's tables stay in this process, where a worker costs more than it
    saves."""
    session = session or open_session(config, device, autocast_cache)
    configured = build_policy(config.policy).cfg.name
    table: dict[str, Estimate | str] = {}
    heads: dict[str, Estimate | str] = {}
    tasks: list[Task] = []
    own_policy = known.policy if known is not None else configured if first is not None else None
    own_loss = known.loss if known is not None else config.loss.name if first is not None else None
    for name in POLICIES if only is None else [n for n in POLICIES if n in only]:
        if name == own_policy:
            if known is not None:
                table[name] = known
        elif not policies:
            continue
        elif POLICIES[name].caps.planned_first and (plans or {}).get(name) is None:
            table[name] = POLICIES[name].caps.unplanned
        elif why := POLICIES[name].caps.not_estimated(config.trainer.compile):
            table[name] = why
        else:
            tasks.append((name, None))
    for name in LOSSES if losses else ():
        if name == own_loss:
            if known is not None:
                heads[name] = known
        else:
            tasks.append((configured, name))
    startup_s = _worker_startup_s() if startup_s is None else startup_s
    fake_cpu = not session.offloads
    done: dict[Task, Estimate | str] = {}
    pool = None
    futures = []
    try:
        groups = _groups(tasks, session, config, plans) if workers > 1 and len(tasks) > 2 else None
        step_s = None
        t0 = time.perf_counter()
        if first is not None:
            known = first()
            table[known.policy] = known
            if losses:
                heads[known.loss] = known
            step_s = time.perf_counter() - t0
        elif groups and (probe := next((k for k, (_, refused) in groups.items() if not refused), None)):
            probed = groups.pop(probe)[0]  # one step timed here before deciding (its group takes its figures)
            one = _run_tasks(config, session.device, plans, autocast_cache, probed, session, known)
            step_s = time.perf_counter() - t0
            done |= one
            if known is None and isinstance(measured := one[probed[0]], Estimate):
                known = measured
        shares = [tasks] if groups is None else [[t for g, _ in groups.values() for t in g]]
        if groups and step_s is not None and len(groups) * step_s * (workers - 1) / workers > startup_s:
            # the step this process already holds (`known`) stays here: a worker would measure it again
            mine = groups.pop((_same_run(known.plan, fake_cpu), known.loss), ([], False))[0] if known else []
            shares = _split(mine, [g for g, _ in groups.values()], workers)
        if len(shares) > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            from trainer.interpreter import lean_exit

            spawn = multiprocessing.get_context("spawn")
            pool = ProcessPoolExecutor(len(shares) - 1, mp_context=spawn, initializer=lean_exit)
            futures = [pool.submit(_run_tasks, config, session.device, plans, autocast_cache, t) for t in shares[1:]]
        done |= _run_tasks(config, session.device, plans, autocast_cache, shares[0], session, known)
        for f in futures:
            done |= f.result()
    except BaseException:
        if pool is not None:  # a failure here: the workers' shares are not waited for
            pool.shutdown(wait=False, cancel_futures=True)
            pool = None
        raise
    finally:
        if pool is not None:
            pool.shutdown()
    for (name, loss), value in done.items():
        if loss is None:
            table[name] = value
        else:
            heads[loss] = value
    return ({n: table[n] for n in POLICIES if n in table}, {n: heads[n] for n in LOSSES if n in heads})


def _run_tasks(
    config: Config,
    device: str,
    plans: dict[str, Plan] | None,
    autocast_cache: bool,
    tasks: list[Task],
    session: Session | None = None,
    known: Estimate | None = None,
) -> dict[Task, Estimate | str]:
    """Each (policy, loss head) of `tasks` on `session` (a new one in a worker process), each run measured once."""
    own = session is None
    session = session or open_session(config, device, autocast_cache)
    configured = build_policy(config.policy)
    fake_cpu = not session.offloads
    measured: dict[tuple[str, str], Estimate] = {}
    if known is not None:
        measured[(_same_run(known.plan, fake_cpu), known.loss)] = known
    current = config.loss
    out: dict[Task, Estimate | str] = {}
    try:
        for name, loss_name in tasks:
            try:
                policy = configured if name == configured.cfg.name else default_policy(name)
                if name in (plans or {}):
                    policy.choose(plans[name].treatments)  # type: ignore[index]
                loss = None if loss_name is None else replace(current, name=loss_name)
                with quiet_policy_notices():
                    policy.check(session.module.adapter.n_layer, session.module.adapter.attention)
                    plan = resolve_plan(policy, session.module.adapter).describe()
                    key = (_same_run(plan, fake_cpu), loss_name or current.name)
                    if key in measured:
                        out[(name, loss_name)] = replace(measured[key], policy=name, plan=plan)
                        continue
                    out[(name, loss_name)] = measured[key] = measure(session, policy, loss)
            except (PolicyError, ValueError) as e:  # a policy this model refuses; a loss head this torch lacks
                out[(name, loss_name)] = str(e)
    finally:
        if own:
            session.close()
    return out


def _groups(
    tasks: list[Task], session: Session, config: Config, plans: dict[str, Plan] | None
) -> dict[Any, tuple[list[Task], bool]]:
    """`tasks` by the step they run, keyed as `_run_tasks` keys its measured steps (one of a group is measured, the
    others take its figures), each with whether the policy refused this model (no step, nearly free)."""
    fake_cpu = not session.offloads
    configured = build_policy(config.policy)
    groups: dict[Any, tuple[list[Task], bool]] = {}
    for name, loss in tasks:
        policy = configured if name == configured.cfg.name else default_policy(name)
        try:
            if name in (plans or {}):
                policy.choose(plans[name].treatments)  # type: ignore[index]
            with quiet_policy_notices():
                policy.check(session.module.adapter.n_layer, session.module.adapter.attention)
            plan = resolve_plan(policy, session.module.adapter).describe()
            key: Any = (_same_run(plan, fake_cpu), loss or config.loss.name)
            refused = False
        except PolicyError:
            key, refused = (name, loss), True
        groups.setdefault(key, ([], refused))[0].append((name, loss))
    return groups


def _split(mine: list[Task], groups: list[list[Task]], workers: int) -> list[list[Task]]:
    """`mine` (steps this process holds already) and `groups` into `workers` shares of about equal work, a worker
    being charged one step for starting up."""
    shares: list[list[Task]] = [list(mine)] + [[] for _ in range(workers - 1)]
    load = [0.0] + [1.0] * (workers - 1)
    for group in groups:
        i = min(range(workers), key=lambda k: load[k])
        shares[i] += group
        load[i] += 1.0
    return [shares[0]] + [s for s in shares[1:] if s]


_STARTUP_S: list[float] = []


def _worker_startup_s() -> float:
    """What a spawned worker repeats before its first step, its imports and its session: this process's CPU time at
    its first table, kept for its later ones (by then it has done work a worker does not repeat)."""
    if not _STARTUP_S:
        _STARTUP_S.append(time.process_time())
    return _STARTUP_S[0]


def _same_run(plan: str, on_cpu: bool) -> str:
    """Plans that run the same step: estimated for a CPU, `offload` moves nothing, so it is `none`."""
    return plan.replace(":offload", ":none") if on_cpu else plan


@contextlib.contextmanager
def quiet_policy_notices() -> Iterator[None]:
    """Estimating every policy must not print each one's one-time notice (e.g. offload on CPU)."""
    from trainer import policies

    logger = logging.getLogger(policies.__name__)
    level = logger.level
    said = set(policies.base._said)
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        policies.base._said.intersection_update(said)  # a later real run still gets its notice
