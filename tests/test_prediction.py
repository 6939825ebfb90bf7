"""Every run predicts itself (callbacks/prediction.py): summary.json carries the estimator's peaks beside the
measured ones with the signed error of each, TensorBoard charts them together, the report has the columns;
`measure.predict=false` turns it off; a model the estimator cannot run is one line and the run goes on; the
prediction does not change the run (its RNG is left as it was)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.test_estimate import ESTIMATE_SLACK_BYTES, ESTIMATE_TOLERANCE
from trainer.core.run import train
from trainer.formatting import MIB
from trainer.measure import metrics as M

RUN = [
    "trainer.max_steps=3",
    "trainer.enable_checkpointing=false",
    "measure.warmup_steps=1",
    "measure.activation_every_n_steps=1",
    "trainer.val_batches=1",
    "measure.predict=true",
]


@pytest.mark.parametrize("policy", ["none", "full", "op_sac"])
def test_a_run_carries_its_prediction_and_its_error(compose_cfg: Any, tmp_path: Path, policy: str) -> None:
    summary = train(compose_cfg(f"policy={policy}", *RUN), tmp_path / policy)
    assert summary["status"] == "completed"
    for predicted, measured, error in M.PREDICTIONS[:2]:  # CPU: the activation and whole-step peaks
        p, m = summary[predicted], summary[measured]
        assert summary[error] == pytest.approx((p - m) / m)
        # the estimate's own contract, now checked in every run
        assert abs(summary[error]) <= ESTIMATE_TOLERANCE and abs(p - m) * MIB <= ESTIMATE_SLACK_BYTES, (policy, p, m)
    assert M.PREDICTION_NOTE not in summary
    acc = EventAccumulator(str(tmp_path / policy), size_guidance={"scalars": 0})
    acc.Reload()
    line = [e.value for e in acc.Scalars(M.PREDICTED_ACTIVATION_PEAK)]
    assert len(line) == 2 and line[0] == line[1] == pytest.approx(summary[M.PREDICTED_ACTIVATION_PEAK_KEY])


def test_prediction_off_and_the_run_is_the_same(compose_cfg: Any, tmp_path: Path) -> None:
    on = train(compose_cfg("policy=full", *RUN), tmp_path / "on")
    off = train(compose_cfg("policy=full", *RUN[:-1], "measure.predict=false"), tmp_path / "off")
    assert not {k for k in off if k.startswith("predicted_") or k.endswith("_error")}
    # the estimator ran at fit start in one of them: the same losses to the bit (its RNG was left as it was)
    assert on["final_train_loss"] == off["final_train_loss"] and on["final_val_loss"] == off["final_val_loss"]


def test_a_model_the_estimator_cannot_run_is_one_line_and_the_run_goes_on(
    compose_cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer.estimate as estimate
    from trainer.errors import ConfigError

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ConfigError("cannot estimate this model on fake tensors: aten.nonzero in Router.forward")

    monkeypatch.setattr(estimate, "open_session", refuse)
    summary = train(compose_cfg("policy=full", *RUN), tmp_path / "refused")
    assert summary["status"] == "completed"
    assert summary[M.PREDICTED_ACTIVATION_PEAK_KEY] is None and summary[M.ACTIVATION_PEAK_ERROR] is None
    assert (
        summary[M.PREDICTION_NOTE] == "not predicted: cannot estimate this model on fake tensors: aten.nonzero in "
        "Router.forward"
    )


def test_the_report_shows_estimate_and_error(compose_cfg: Any, tmp_path: Path) -> None:
    from trainer.report import build_report

    (tmp_path / "sweep").mkdir()
    train(compose_cfg("policy=full", *RUN), tmp_path / "sweep" / "0")
    report = build_report(tmp_path / "sweep")
    header = next(line for line in report.markdown.splitlines() if line.startswith("| job"))
    assert "est. act. MiB" in header and "act. err" in header
