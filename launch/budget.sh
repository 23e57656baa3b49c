# Stages of a benchmark run on a lent machine while a time budget lasts (sourced by the gpu_*
# launch scripts; a lease on a shared GPU is short). Set OUT and deadline (in $SECONDS) first.
#
#   stage NAME NEEDS_S COMMAND...
#
# runs COMMAND (its output to OUT/NAME.log) only if NEEDS_S seconds of the budget are left,
# stopped at the budget's end; OUT/stages.log says which ran, which were skipped and how each
# ended, and the log's last lines that are not table rows are printed.
stage() {
  local name=$1 needs_s=$2 left=$((deadline - SECONDS))
  shift 2
  if ((left < needs_s)); then
    echo "$name: skipped, ${left} s left of the budget, needs about ${needs_s} s" | tee -a "$OUT/stages.log"
    return
  fi
  echo "$name: started with ${left} s left" | tee -a "$OUT/stages.log"
  PYTHONUNBUFFERED=1 timeout "$left" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  grep -v '^|' "$OUT/$name.log" | tail -n 4
  echo "$name: exit $status at ${SECONDS} s" | tee -a "$OUT/stages.log"
}
