#!/usr/bin/env bash
# A screenshot of TensorBoard's scalars dashboard for one run, taken in a real headless browser.
#
#   bash tools/screenshot_tensorboard.sh runs/tiny/tensorboard docs/images/tensorboard_scalars.png
#
# Starts `tensorboard` on a free loopback port (127.0.0.1, rtd_scale.launch_env.free_port), waits
# until it lists the run, has Chromium (Debian: apt-get install -y chromium) render the scalars
# dashboard into OUT.png, and stops TensorBoard again (also on error or Ctrl-C). The run is shown
# under its run directory's name (LOGDIR's parent when LOGDIR is a `tensorboard` folder), through
# a link in a temporary logdir; smoothing is 0, so every logged point is drawn as logged.
#
# Environment:
#   TENSORBOARD   the tensorboard executable (default: .venv/bin/tensorboard of this checkout, else
#                 the one on PATH)
#   CHROMIUM      the browser (default: chromium, else chromium-browser)
#   TAG_FILTER    the dashboard's tag regex (default: the losses, the held-out AUC and the lr)
#   BUDGET_MS     the browser's virtual time for TensorBoard's JavaScript to draw the charts
#                 (default 15000; raise it if the picture comes out without charts)
#   WINDOW        the browser window, WIDTH,HEIGHT (default 1400,1000)
# Chromium runs with --no-sandbox (needed as root), without a GPU, network services or a profile
# of its own (a fresh --user-data-dir, removed afterwards).
set -euo pipefail

die() { echo "error: $*" >&2; exit 1; }

[ $# -eq 2 ] || die "usage: bash tools/screenshot_tensorboard.sh LOGDIR OUT.png"
logdir="$1"
out="$2"
[ -d "$logdir" ] || die "$logdir: no such directory (LOGDIR is a run's tensorboard/ folder)"
compgen -G "$logdir/events.out.tfevents.*" > /dev/null \
  || die "$logdir: no TensorBoard events (events.out.tfevents.*) in it; pass a run's tensorboard/ folder"
case "$out" in *.png) ;; *) die "$out: the screenshot is a PNG, name it OUT.png" ;; esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tensorboard="${TENSORBOARD:-}"
if [ -z "$tensorboard" ]; then
  if [ -x "$root/.venv/bin/tensorboard" ]; then
    tensorboard="$root/.venv/bin/tensorboard"
  else
    tensorboard="$(command -v tensorboard || true)"
  fi
fi
[ -x "$tensorboard" ] \
  || die "tensorboard not found: source tools/setup_env.sh, or set TENSORBOARD=/path/to/tensorboard"
chromium="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
[ -n "$chromium" ] || die "chromium not found: apt-get update && apt-get install -y chromium, or set CHROMIUM"
python="$(dirname "$tensorboard")/python"
[ -x "$python" ] || python="$(command -v python3)"

logdir="$(cd "$logdir" && pwd)"
name="$(basename "$logdir")"
[ "$name" = tensorboard ] && name="$(basename "$(dirname "$logdir")")"
work="$(mktemp -d)"
tb_pid=""
cleanup() {
  if [ -n "$tb_pid" ]; then
    kill "$tb_pid" 2> /dev/null || true
    wait "$tb_pid" 2> /dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir "$work/logdir" "$work/profile"
ln -s "$logdir" "$work/logdir/$name"

port="$(PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$python" -c \
  'from rtd_scale.launch_env import free_port; print(free_port())')" \
  || die "no free port: rtd_scale.launch_env.free_port failed in $python"
"$tensorboard" --logdir "$work/logdir" --host 127.0.0.1 --port "$port" > "$work/tensorboard.log" 2>&1 &
tb_pid=$!
url="http://127.0.0.1:$port"
listed() {  # TensorBoard answers and has read the run
  "$python" -c 'import json, sys, urllib.request
sys.exit(sys.argv[2] not in json.load(urllib.request.urlopen(sys.argv[1], timeout=2)))' \
    "$url/data/runs" "$name" 2> /dev/null
}
for _ in $(seq 1 120); do  # up to 60 s for TensorBoard to start and read the run's events
  kill -0 "$tb_pid" 2> /dev/null \
    || die "tensorboard exited before serving: $(tail -n 1 "$work/tensorboard.log")"
  listed && break
  sleep 0.5
done
listed || die "tensorboard at $url did not list the run $name within 60 s"

filter="$("$python" -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' \
  "${TAG_FILTER:-loss/mlm|loss/rtd|rtd/auc|optim/lr}")"
mkdir -p "$(dirname "$out")"
tmp="$out.tmp$$.png"
"$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$work/profile" --window-size="${WINDOW:-1400,1000}" \
  --virtual-time-budget="${BUDGET_MS:-15000}" --screenshot="$tmp" \
  "$url/#scalars&tagFilter=$filter&_smoothingWeight=0" > "$work/chromium.log" 2>&1 \
  || { rm -f "$tmp"; die "chromium failed: $(grep -v gl_utils "$work/chromium.log" | tail -n 1)"; }
[ -s "$tmp" ] || { rm -f "$tmp"; die "chromium wrote no screenshot: $(tail -n 1 "$work/chromium.log")"; }
mv -f "$tmp" "$out"
echo "wrote $out (TensorBoard scalars of $name, $logdir)"
