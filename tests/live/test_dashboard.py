"""The shipped Grafana dashboard loads the ways Grafana loads dashboards: imported by hand,
provisioned from a file, or by a sidecar. The last two never fill an import-time input
(`${DS_PROMETHEUS}`), so the data source is a dashboard variable every query names, and a
panel that draws series of different units says the unit of each."""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "tracekit-live.json"


def _datasource_refs(o, path=""):
    if isinstance(o, dict):
        if "datasource" in o:
            yield path, o["datasource"]
        for k, v in o.items():
            yield from _datasource_refs(v, f"{path}/{k}")
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from _datasource_refs(v, f"{path}/{i}")


def test_the_data_source_is_a_variable_not_an_import_input():
    text = DASHBOARD.read_text()
    d = json.loads(text)
    assert "__inputs" not in d and "${DS_" not in text
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    # the variable comes first: the `run` query and every panel resolve through it
    assert d["templating"]["list"][0]["name"] == "datasource"
    refs = list(_datasource_refs(d))
    panels_and_targets = sum(1 + len(p["targets"]) for p in d["panels"])
    assert len(refs) == panels_and_targets + 1  # + the `run` variable's query
    bad = [(p, r) for p, r in refs if r != {"type": "prometheus", "uid": "${datasource}"}]
    assert not bad, bad


def test_a_panel_of_mixed_units_names_each_series_unit():
    d = json.loads(DASHBOARD.read_text())
    health = next(p for p in d["panels"] if p["title"] == "Live sink health")
    units = {
        o["matcher"]["options"]: o["properties"][0]["value"]
        for o in health["fieldConfig"]["overrides"]
        if o["matcher"]["id"] == "byFrameRefID" and o["properties"][0]["id"] == "unit"
    }
    refs = {t["refId"]: t["expr"] for t in health["targets"]}
    assert set(units) == set(refs)
    # a counter of batches and rows, a 0/1 flag, CPU seconds per second (cores)
    assert units["C"] == "bool" and "tracekit_live_final" in refs["C"]
    assert units["D"] == "percentunit" and "cpu_seconds_total" in refs["D"]
