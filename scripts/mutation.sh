#!/usr/bin/env bash
# The mutation score of one pure-Python module: mutmut 3.8 (the `dev` extra; [tool.mutmut] in pyproject.toml) mutates
# the module alone, runs the module's own test files against each mutant, and this prints killed / mutants and the
# survivors. Usage: bash scripts/mutation.sh MODULE, MODULE one of tool_parse, guard, chat, settings, tensor_check
# (or its path). Figures and the survivors judged equivalent: docs/testing.md, "Mutation score".
#
# mutmut works in ./mutants/ (a copy of the package and tests/, ignored by git); each run starts from a fresh one, so
# the score never mixes results of another module or of older tests. Afterwards `mutmut show NAME` prints a
# survivor's diff. Runs at the lowest CPU priority (nice 19); MUTMUT_CHILDREN sets how many mutants run at once
# (default: 1). One run at a time per checkout (they share ./mutants/).
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  tool_parse|clover_jax/serving/tool_parse.py)
    module=clover_jax/serving/tool_parse.py
    tests=(tests/test_serve_tools.py tests/test_mutants_tool_parse.py) ;;
  guard|clover_jax/serving/guard.py)
    module=clover_jax/serving/guard.py
    S=tests/test_serve_security.py  # its tests of the door through the whole app (not the live-server ones)
    tests=("$S::test_every_route_but_health_needs_a_key" "$S::test_every_key_is_compared_in_constant_time"
           "$S::test_keys_are_never_logged_echoed_or_exported" "$S::test_body_limit_before_parsing"
           "$S::test_hostile_bodies" "$S::test_one_access_line_per_request" tests/test_mutants_guard.py) ;;
  chat|clover_jax/serving/chat.py)
    module=clover_jax/serving/chat.py
    tests=(tests/test_serve_tools.py tests/test_serve_api.py tests/test_mutants_chat.py) ;;
  settings|clover_jax/sampler/settings.py)
    module=clover_jax/sampler/settings.py
    # (less its two compile-bound tests, 15 s of every mutant they reach; the other tests cover their settings)
    tests=(tests/test_settings.py tests/test_mutants_settings.py
           -k "not each_compiled_setting_compiles_a_new_program and not traced_settings_never_recompile") ;;
  tensor_check|clover_jax/convert/tensor_check.py)
    module=clover_jax/convert/tensor_check.py
    tests=(tests/test_convert_check.py::test_text_model_problems_fail_and_are_named
           tests/test_mutants_tensor_check.py) ;;
  *)
    echo "usage: bash scripts/mutation.sh {tool_parse|guard|chat|settings|tensor_check}" >&2
    exit 2 ;;
esac
# A test file that does not exist yet is left out (pytest would stop on it); BASELINE=1 leaves out the
# tests/test_mutants_*.py files too (the score the module's other tests give).
selection=()
for t in "${tests[@]}"; do
  [[ -n ${BASELINE:-} && $t == tests/test_mutants_* ]] && continue
  [[ $t == *.py && ! -f $t ]] || selection+=("$t")
done

export JAX_PLATFORMS=cpu
rm -rf mutants
# mutmut reads [tool.mutmut] once; narrow what it mutates and which tests it runs to this module, then run it as
# `mutmut run` would.
rc=0
MUTATE="$module" SELECTION="$(printf '%s\n' "${selection[@]}")" CHILDREN="${MUTMUT_CHILDREN:-1}" nice -n 19 python - <<'EOF' || rc=$?
import os
import sys

from mutmut.configuration import config

cfg = config()
cfg.only_mutate = [os.environ["MUTATE"]]
cfg.pytest_add_cli_args_test_selection = os.environ["SELECTION"].splitlines()

from mutmut.__main__ import cli  # noqa: E402

sys.argv = ["mutmut", "run", "--max-children", os.environ["CHILDREN"]]
cli()
EOF

# The score, from mutmut's record of each mutant (mutants/<module>.meta).
MUTATE="$module" python - <<'EOF'
import collections
import json
import os
import sys

from mutmut.stats import status_by_exit_code

module = os.environ["MUTATE"]
try:
    with open(f"mutants/{module}.meta") as f:
        codes = json.load(f)["exit_code_by_key"]
except FileNotFoundError:
    sys.exit(f"mutmut left no results for {module} (see its output above)")
status = {name: status_by_exit_code[code] if code is not None else "not checked" for name, code in codes.items()}
counts = collections.Counter(status.values())
killed = counts["killed"]  # a timeout is listed, not counted: on a loaded machine it can be the machine's
total = len(status)
print()
for name in sorted(n for n, s in status.items() if s != "killed"):
    print(f"    {status[name]:<12} {name}")
print(f"{module}: {killed}/{total} mutants killed ({100 * killed / max(total, 1):.1f}%); "
      + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
EOF
exit $rc
