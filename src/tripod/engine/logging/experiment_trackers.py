"""The `wandb` and `mlflow` backends of `trainer.logger`: a run named after trainer.project_name /
trainer.experiment_name (verl's names), the resolved config as the run's config, scalars per step, and tables
(validation samples).

Both packages are optional and imported only when their backend is chosen; `missing_tracker_packages` turns a
missing one into one line naming the extra to install (`pip install 'tripod[wandb]'`), checked with the rest of the
config before any model is built.

- wandb: `wandb.init(project, name, config, dir)`; `dir` is $WANDB_DIR when set, else the run directory.
  `WANDB_MODE=offline` writes the run under `<dir>/wandb/offline-run-*` (`wandb sync` uploads it later).
- mlflow: experiment `project_name`, run `experiment_name`, at $MLFLOW_TRACKING_URI when set, else a local file
  store `file:<run_dir>/mlruns` (`mlflow ui --backend-store-uri <run_dir>/mlruns`). MLflow 3 keeps its file store
  behind MLFLOW_ALLOW_FILE_STORE=true, which this sink sets for that default store only. The config is logged as
  flattened params plus the artifact config.json; a table as the JSON artifact `<name>/step_<k>.json` in MLflow's
  table layout ({"columns": [...], "data": [[...], ...]}), which needs no pandas.
"""
from __future__ import annotations

import importlib.util
import os
import re
import time
from typing import Any, Mapping, Sequence

EXTRA_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}  # backend: (module, setup.py extra)
_MLFLOW_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")
_MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit; metrics allow 1000)


def missing_tracker_packages(backends: Sequence[str], key: str = "trainer.logger") -> list[str]:
    """One problem line per chosen backend whose package is not importable."""
    out = []
    for backend in backends:
        if backend in EXTRA_PACKAGES:
            module, extra = EXTRA_PACKAGES[backend]
            if importlib.util.find_spec(module) is None:
                out.append(f"{key} includes {backend!r} but the {module} package is not installed; "
                           f"pip install 'tripod[{extra}]' (or drop {backend!r} from {key})")
    return out


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_config(v, name + "."))
        else:
            out[name] = v
    return out


class WandbSink:
    """One wandb run; `log`, `log_table`, `close`."""

    def __init__(self, run_dir: str, project: str, name: str, config: Mapping[str, Any] | None) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=project, name=name, config=dict(config or {}),
                              dir=os.environ.get("WANDB_DIR") or run_dir)

    def log(self, scalars: Mapping[str, Any], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        self.run.log({name: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """One MLflow run (through `MlflowClient`, no global fluent state); `log`, `log_table`, `close`."""

    def __init__(self, run_dir: str, project: str, name: str, config: Mapping[str, Any] | None) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = "file:" + os.path.abspath(os.path.join(run_dir, "mlruns"))
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        if config:
            params = [Param(self.key(k), str(v)[:6000]) for k, v in flatten_config(config).items()]
            for i in range(0, len(params), _MLFLOW_BATCH):
                self.client.log_batch(self.run_id, params=params[i:i + _MLFLOW_BATCH])
            self.client.log_dict(self.run_id, dict(config), "config.json")

    @staticmethod
    def key(name: str) -> str:
        """MLflow keys allow alphanumerics, `_ - . /` and spaces; anything else becomes `_`."""
        return _MLFLOW_BAD_CHARS.sub("_", name)

    def log(self, scalars: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(self.key(k), float(v), now, step) for k, v in scalars.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        self.client.log_dict(self.run_id, {"columns": list(columns), "data": [list(r) for r in rows]},
                             f"{self.key(name)}/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS = {"wandb": WandbSink, "mlflow": MlflowSink}
