# Renames of issue 22 point 5 (branch toplevel): the command line in kvmem/cli/, the simulation in
# kvmem/simulate/, the pydantic spec base in kvmem/_specs.py.
# Apply with:  sed -i -f RENAMES_toplevel.sed FILE...   (idempotent: a second run changes nothing)
# then `ruff check --fix FILE...` (a renamed import may need re-sorting or merging, e.g. two
# `from kvmem.simulate import` lines). Meant for kvmem/, tests/, benchmarks/, docs and README;
# not for examples/, whose scripts define a `_Parser` class of their own (renaming it there is
# harmless but pointless).
#
#   kvmem/cli.py            -> kvmem/cli/__init__.py (build_parser, main), kvmem/cli/__main__.py
#                              (python -m kvmem.cli), kvmem/cli/args.py (Parser, number and the
#                              shared option types), kvmem/cli/_plan.py (kvmem plan)
#   kvmem/_simulate_cli.py  -> kvmem/cli/_simulate.py (kvmem simulate)
#   kvmem/_fuzz_cli.py      -> kvmem/cli/_fuzz.py (kvmem fuzz)
#   kvmem/simulate.py       -> kvmem/simulate/__init__.py (the public names) + kvmem/simulate/_run.py
#   kvmem/_simulation.py    -> kvmem/simulate/_simulation.py
#   kvmem/_workload.py      -> kvmem/simulate/_workload.py (Arrivals also public in kvmem.simulate)
#   kvmem/_models.py        -> kvmem/_specs.py
#
# The public import paths stay: kvmem.cli.main, kvmem.cli.build_parser, python -m kvmem.cli, the
# console script kvmem = "kvmem.cli:main", and every name of kvmem.simulate.

# -- the CLI's parser and number type, private in kvmem.cli, public in kvmem.cli.args --------------
s/^\([[:space:]]*\)from kvmem\.cli import _number, _Parser$/\1from kvmem.cli.args import Parser, number/
s/^\([[:space:]]*\)from kvmem\.cli import _Parser, _number$/\1from kvmem.cli.args import Parser, number/
s/\b_Parser\b/Parser/g
s/\b_number(/number(/g
s/^\([[:space:]]*\)from kvmem\.cli import dtypes_asked\b/\1from kvmem.cli.args import dtypes_asked/
s/^\([[:space:]]*\)from kvmem\.cli import format_plans\b/\1from kvmem.cli._plan import format_plans/
# kvmem plan's functions (_plot, _pyplot, _plans, format_plans ...) are in kvmem.cli._plan
s/^\([[:space:]]*\)import kvmem\.cli as cli$/\1import kvmem.cli._plan as cli/
# -- the subcommands ------------------------------------------------------------------------------
s/^\([[:space:]]*\)from kvmem import _fuzz_cli$/\1from kvmem.cli import _fuzz as _fuzz_cli/
s/\bkvmem\._fuzz_cli\b/kvmem.cli._fuzz/g
s/\bkvmem\._simulate_cli\b/kvmem.cli._simulate/g
s#\bkvmem/_fuzz_cli\.py\b#kvmem/cli/_fuzz.py#g
s#\bkvmem/_simulate_cli\.py\b#kvmem/cli/_simulate.py#g
s#\bkvmem/cli\.py\b#kvmem/cli/#g
# -- the simulation -------------------------------------------------------------------------------
s/^\([[:space:]]*\)from kvmem\._workload import Arrivals$/\1from kvmem.simulate import Arrivals/
s/\bkvmem\._workload\b/kvmem.simulate._workload/g
s/\bkvmem\._simulation\b/kvmem.simulate._simulation/g
s#\bkvmem/_workload\.py\b#kvmem/simulate/_workload.py#g
s#\bkvmem/_simulation\.py\b#kvmem/simulate/_simulation.py#g
s#\bkvmem/simulate\.py\b#kvmem/simulate/#g
# -- the specs ------------------------------------------------------------------------------------
s/\bkvmem\._models\b/kvmem._specs/g
s#\bkvmem/_models\.py\b#kvmem/_specs.py#g
