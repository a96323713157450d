# abp_report_ctest_failures BUILD_DIR — after a red ctest run, prints the end of each failed
# test's own output, then the failed names again, so that the last lines of a CI log (often all a
# CI summary keeps) say what failed and why, not only that ctest did.
abp_report_ctest_failures() {
  local build=$1 lines=${ABP_FAILURE_LINES:-30}
  local failed="$build/Testing/Temporary/LastTestsFailed.log" log="$build/Testing/Temporary/LastTest.log"
  [[ -f "$failed" && -f "$log" ]] || return 0
  local names=() name
  while IFS=: read -r _ name; do names+=("$name"); done < "$failed"
  for name in "${names[@]}"; do
    echo
    echo "===== the last $lines lines of failed test '$name' (all of it: $log) ====="
    # A test's record runs from "N/M Testing: NAME" to '"NAME" end time'.
    awk -v name="$name" '
      $0 ~ "^[0-9]+/[0-9]+ Testing: " && substr($0, index($0, "Testing: ") + 9) == name { inside = 1 }
      inside { print }
      inside && $0 == "\"" name "\" end time" { inside = 0 }
      inside && index($0, "\"" name "\" end time:") == 1 { inside = 0 }' "$log" |
      grep -v '^"' | tail -n "$lines"
  done
  echo
  echo "failed: ${names[*]}"
}
