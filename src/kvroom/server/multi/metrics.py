"""``/metrics`` of a multi-model server: every model's series with a ``model`` label, plus the
arbiter's own.

Each model keeps the single-model registry (``server/metrics.py``), which outlives its
evictions; at scrape time ``LabelledModels`` reads them all and merges the families of the same
name, each sample labelled by its model. The arbiter's series::

    kvroom_arbiter_moves_total{kind="grow|shrink|evict|load", model}   one per decision applied
    kvroom_memory_budget_bytes / kvroom_kv_pool_budget_bytes            the budget now
    kvroom_model_loaded{model}                                          1 loaded, 0 evicted
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

MOVE_KINDS = ("grow", "shrink", "evict", "load")


class LabelledModels(Collector):
    """Every ``(model name, registry)``'s families, merged by name, labelled ``model``."""

    def __init__(self, registries: Callable[[], Iterable[tuple[str, CollectorRegistry]]]) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for model, registry in self._registries():
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = out
                for s in family.samples:
                    labels = {"model": model, **s.labels}
                    out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from merged.values()


class BudgetGauges(Collector):
    """The budget, the pool budget and which models are loaded, read at scrape time."""

    def __init__(self, read: Callable[[], tuple[int, int, dict[str, bool]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        budget, pool_budget, loaded = self._read()
        yield GaugeMetricFamily(
            "kvroom_memory_budget_bytes", "The memory budget all models share.", value=budget
        )
        yield GaugeMetricFamily(
            "kvroom_kv_pool_budget_bytes",
            "What the KV pools may hold together (budget less the loaded models' fixed bytes).",
            value=pool_budget,
        )
        family = GaugeMetricFamily(
            "kvroom_model_loaded", "1 while the model is loaded, 0 once evicted.", labels=["model"]
        )
        for name, is_loaded in loaded.items():
            family.add_metric([name], 1.0 if is_loaded else 0.0)
        yield family


class MultiMetrics:
    """The server's registry: the models' series, the budget gauges, the arbiter's counter."""

    def __init__(
        self,
        registries: Callable[[], Iterable[tuple[str, CollectorRegistry]]],
        budget: Callable[[], tuple[int, int, dict[str, bool]]],
        names: Iterable[str],
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(LabelledModels(registries))
        self.registry.register(BudgetGauges(budget))
        self.moves = Counter(
            "kvroom_arbiter_moves",
            "Decisions the arbiter applied: pool grown, shrunk, model evicted or (re)loaded.",
            ["kind", "model"],
            registry=self.registry,
        )
        for name in names:
            for kind in MOVE_KINDS:
                self.moves.labels(kind=kind, model=name)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
