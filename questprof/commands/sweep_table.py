"""`questprof sweep --budgets-file budgets.toml`: the Quest step timed with each layer's budget.

The table (core/budgets.py, written by `questprof fidelity`) names a budget per layer of the
scenario's model, or "dense". The sweep then runs the table's page size and mode, with the
table's largest budget as the grid's budget (the top-K and sparse attention rows, and the
pools), and times the Quest step over a pass of simulated layers that walks the table: layer i
of the pass runs layer i mod n of the table, Quest with its budget or dense attention, the pass
a whole number of tables long. The quest row carries the table (`budgets_file`,
`layer_budgets`) and the mean work of its layers, so its speedup against the dense row (the
same pass, every layer dense) is the model's attention with these budgets.
"""

from __future__ import annotations

from dataclasses import replace

from questprof.core import model
from questprof.core.budgets import BudgetTable, read_table
from questprof.core.config import ConfigError


def apply_table(args, layers: int):
    """(args with the table's page size, largest budget and mode, the BudgetTable) for a
    model of `layers` layers; args unchanged and None without --budgets-file. ConfigError
    (one line) for a bad table, and for one that keeps every layer dense (timed as Quest at
    one page's budget, it showed budget 8 and speedups over a pass of dense layers)."""
    if not args.budgets_file:
        return args, None
    table = read_table(args.budgets_file, layers)
    if table.largest is None:
        raise ConfigError(f"budget table {args.budgets_file} keeps every layer dense: there is "
                          "no Quest step to time (the sweep's dense rows are that attention); "
                          "give a table with a sparse layer")
    held = {"page_size": str(table.page_size), "budget": str(table.largest), "mode": table.mode}
    for name, value in held.items():  # a flag the table overrides was dropped in silence
        if name in getattr(args, "given", ()) and str(getattr(args, name)) != value:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: budget table "
                              f"{args.budgets_file} sets {name.replace('_', ' ')} {value}; "
                              "leave the flag out")
    return replace(args, **held), table


def pass_layers(layers: int, table: BudgetTable | None) -> int:
    """Simulated layers of a pass: a whole number of tables, at least `layers`."""
    if table is None:
        return layers
    return -(-max(layers, 1) // table.layers) * table.layers


def _k_pages(cfg, table: BudgetTable) -> list[int | None]:
    """Pages kept per table layer at cfg's length (None: dense, also when it covers all)."""
    return [None if b is None or b >= cfg.length else b // table.page_size
            for b in table.budgets]


def launcher(work, table: BudgetTable):
    """launch(layer) of the Quest step with layer (mod the table) its own budget."""
    b, q, cfg = work.backend, work.q, work.cfg
    ks = _k_pages(cfg, table)

    def launch(layer: int):
        kv, k = work.kvs[layer], ks[layer % len(ks)]
        if k is None:
            return b.attention(q, kv)
        if hasattr(b, "quest"):
            return b.quest(q, kv, k, cfg.mode)
        sel, count = b.topk(b.estimate(q, kv, cfg.mode), kv, k)
        return b.attention(q, kv, sel, count)
    return launch


def work(cfg, table: BudgetTable) -> model.StageWork:
    """The mean work of the table's layers: the Quest step at each budget, dense where dense."""
    parts = [model.stage_work(cfg)["dense"] if k is None else
             model.quest_work(replace(cfg, budget=k * table.page_size))
             for k in _k_pages(cfg, table)]
    n = len(parts)
    return model.StageWork("quest", sum(p.read for p in parts) / n,
                           sum(p.unmodelled_read for p in parts) / n,
                           sum(p.write for p in parts) / n, sum(p.flops for p in parts) / n)


def fields(cfg, table: BudgetTable, path: str) -> dict:
    """What a quest row timed with the table says about it: the table, and rho as the mean
    bytes of its layers over dense's (the formula's 1/S + K/P holds per layer only)."""
    dense = model.stage_work(cfg)["dense"].read
    return {"budgets_file": str(path), "layer_budgets": table.text(),
            "rho_model": work(cfg, table).read / dense, "rho_formula": None,
            # the sum of the three stages' measured bytes is at the grid's (largest) budget
            "measured_read_bytes": None, "measured_write_bytes": None, "bytes_source": None}
