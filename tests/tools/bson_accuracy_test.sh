#!/usr/bin/env bash
# The Cdiscount BSON layout trains like the source it was made from: every
# Fashion-MNIST image written as a JPEG picture (quality 90) of a BSON
# product, in source order (make_bson_dump --in-order: products of 1 to 4
# consecutive images of one class, ten-digit category ids), then the same
# job (the example CNN, seed 1, 1 epoch, standalone on the CPU) on the IDX
# files and on the BSON dump. The test accuracies must agree within 0.5
# points (issue 46); both are printed. The dump's category_names.csv (in
# Cdiscount's layout, holding Fashion-MNIST's class names) must name the
# classes of the BSON run's per-class table.
#
#   bson_accuracy_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
BIN=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
FMNIST=/usr/share/datasets/fashion-mnist
fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -d $FMNIST ]] || fail "dataset-fashion-mnist is not installed"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bson"
"$BIN/make_bson_dump" "$FMNIST" "$WORK/bson" --in-order
# Category ids as tests/testing/bson_dump.h makes them (DumpCategoryId).
python3 - "$WORK/bson/category_names.csv" <<'PY'
import sys
names = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
         "Bag", "Ankle boot"]
with open(sys.argv[1], "w") as f:
    f.write("category_id,category_level1,category_level2,category_level3\n")
    for c, name in enumerate(names):
        f.write(f"{1000010653 + 7919 * c},MODE,\"VETEMENTS, ACCESSOIRES\",{name}\n")
PY

# The example job, its dataset swapped for the dump (same normalisation).
python3 - "$SRC/examples/fashion-mnist.json" "$WORK" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
job["model_file"] = sys.argv[1].rsplit("/", 1)[0] + "/" + job["model_file"]
json.dump(job, open(sys.argv[2] + "/idx.json", "w"))
job["dataset"].update(format="DATASET_FORMAT_BSON", path=sys.argv[2] + "/bson",
                      image_channels=1, image_height=28, image_width=28)
json.dump(job, open(sys.argv[2] + "/bson.json", "w"))
PY
accuracy() {  # JOB: the test accuracy of a 1-epoch standalone run.
  "$BIN/pstrain-worker" --standalone "$1" --device cpu --epochs 1 --checkpoint none \
    --data-root "$FMNIST" --data-root "$WORK" >"$1.log" 2>&1 || { cat "$1.log"; fail "$1 failed"; }
  tail -1 "$1.log" | python3 -c 'import json, sys; print(json.load(sys.stdin)["test_accuracy"])'
}
idx=$(accuracy "$WORK/idx.json")
bson=$(accuracy "$WORK/bson.json")
echo "test accuracy after 1 epoch: IDX $idx, BSON $bson"
grep -E "^ +9  +[0-9.]+  +[0-9.]+  +[0-9.]+  Ankle boot$" "$WORK/bson.json.log" ||
  { cat "$WORK/bson.json.log"; fail "the BSON run's per-class table does not name class 9"; }
grep -E "^ +0  .*  T-shirt/top$" "$WORK/bson.json.log" >/dev/null || fail "class 0 is not named"
python3 -c "import sys; d = abs($idx - $bson); print(f'difference {100 * d:.2f} points'); sys.exit(d > 0.005)" ||
  fail "the BSON dump's accuracy is more than 0.5 points from the IDX files'"
echo "PASS"
