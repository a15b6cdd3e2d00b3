#!/usr/bin/env bash
# Drafters for the real target (SmolLM2-135M-Instruct, issue 14), every command in order. Each
# step is resumable: rerun the same line after an interruption and it continues where it stopped.
# Data and features live in $SPECBLOCK_HOME (default ~/.cache/specblock), never in git.
#   experiments/real_drafters.sh data|ask|refs|features|specblock|eagle3|medusa|parallelspec|falcon|sps|finetune|finetune-check|vocab|vocab-heads|export|bench|calibrate|table|packed|compiled|compiled-budgets|lossless|widths|lookup-branch|eval
# One thread each: on this shared 2-core CPU under load ~9, two OpenMP threads spin-waited and
# generation ran 9x slower (3.9 against 30-44 answer tokens/s); data, features and training run
# side by side (featcache --follow picks up new chatgen shards, training new feature shards).
# fp32 for data and features: on an AVX2-only CPU (no native bf16) batched bf16 products ran ~50x slower
# (runtime.target.native_bf16); the drafters train in fp32 there too (--amp auto).
set -euo pipefail
PY=${PY:-.venv/bin/python}
T=smollm2-135m-instruct
H=$($PY -c "from specblock.models import specblock_home; print(specblock_home())")
DATA=$H/data/chatgen/$T          # the target's own greedy answers (jsonl shards of token ids)
REFS=$H/data/reference/$T        # reference answers from ../shared/data in the same format (refanswers)
ASK=$H/data/chatgen-ask/$T       # the target's own answers to instructions it wrote itself (selfask, then chatgen)
ASKS=("$ASK")                    # ... and to those of selfask's other seeds (chatgen-ask-sN, shards askN_*), where made
for d in "$H"/data/chatgen-ask-s*/$T; do [[ -f $d/manifest.json ]] && ASKS+=("$d"); done
FEAT=${FEAT:-$H/features/$T}     # taps, top hidden state, top-8 soft targets (memory-mapped .npy); FEAT= another cache
RUN=${RUN:-$H/runs/$T/specblock} # checkpoints and metrics.jsonl of the SpecBlock drafter
OUT=specblock/assets/drafters/$T/specblock
# Each method's architecture flags, shared by its training and any fine-tune of it (a fine-tune must match them)
declare -A ARCH=(
  [specblock]="--layers 2 --shared-norm --intermediate 1024"
  [eagle3]="--intermediate 1536"
  [medusa]=""
  [parallelspec]="--layers 1 --K 4 --intermediate 1536"
  [falcon]="--layers 1 --block-size 2 --forwards 3 --intermediate 1536"
  [sps]="--layers 2 --draft-hidden 256 --tie-embeddings --intermediate 1024"
)
train() {  # METHOD [RUN_DIR] [more flags]: one drafter from the feature cache, the shared recipe, one thread
  local m=$1 run=${2:-$H/runs/$T/$1} vocab="--draft-vocab 8192 --vocab-corpus 0.5"
  shift; (( $# )) && shift
  [[ $m == sps ]] && vocab=""  # a whole LM over the target's vocabulary
  # shellcheck disable=SC2086  # ARCH and vocab are word lists
  $PY -m specblock.training drafter --method "$m" --target $T --features "$FEAT" $vocab ${ARCH[$m]} --run-dir "$run" \
      --lr 1e-3 --window 257 --batch 4 --max-minutes "${MAX_MINUTES:-120}" --max-steps "${MAX_STEPS:-5000}" \
      --eval-every 50 --ckpt-every 10 --threads 1 "$@"
}
case "${1:-}" in
  data)      # 1. self-generated data: 186 shards of 64 instructions, up to 256 new tokens each, in batches of 16 prompts
    #            of similar length (a shard's prompts are sorted): one batch of 64 padded the prefill to 3.5x its
    #            tokens (1.5x in batches of 16), and the padded prefill was most of a shard's time
    #            FEAT_DTYPE=bfloat16 THREADS=2 BATCH=32: on a CPU with AMX (native bf16 products, ~6x fp32's rate) 210-237
    #            answer tokens/s against 43 in fp32 on 1 thread (325 at stop 53, `ask` 510); a cache's answers and features
    #            keep one dtype. MAX_SHARDS=37 is the shipped drafters' data (2,363 sequences): about 22 minutes there
    #            On an AMD Zen 5 (AVX512-BF16, no AMX; stop 71) the same settings ran 270 answer tokens/s (37 shards, 425,765
    #            answer tokens in 26.3 min), `ask` 399 (14.2 min), `features` 1.1M tokens in 17.3 min (5.2 GB)
    $PY -m specblock.training chatgen --target $T --out $DATA --shard-size 64 --batch ${BATCH:-16} --max-new-tokens 256 \
        --dtype ${FEAT_DTYPE:-float32} --threads ${THREADS:-1} ${MAX_MINUTES:+--max-minutes $MAX_MINUTES} \
        ${MAX_SHARDS:+--max-shards $MAX_SHARDS} ;;  # MAX_SHARDS=n: shards 0..n-1 in all
  ask)       # 1a. chat-like instructions written by the target (selfask: ASK_COUNT=2048 of them, search questions and
    #            requests to an assistant, seed ASK_SEED=0), then its greedy answers to them as chatgen shards ask_NNNNN
    #            (none held out); `features` adds them to the cache. FEAT_DTYPE= / THREADS= / BATCH= / MAX_MINUTES= as for data
    #            Another ASK_SEED=N answers its own instructions into chatgen-ask-sN, shards askN_* (a cache keys shards by name)
    S=${ASK_SEED:-0}
    LIST=$H/data/selfask/$T/instructions_s${S}_n${ASK_COUNT:-2048}.jsonl
    [[ $S == 0 ]] && OUT_ASK=$ASK PFX=ask_ || OUT_ASK=$H/data/chatgen-ask-s$S/$T PFX=ask${S}_
    $PY -m specblock.training selfask --target $T --out "$LIST" --count "${ASK_COUNT:-2048}" --seed "${ASK_SEED:-0}" \
        --dtype ${FEAT_DTYPE:-float32} --threads ${THREADS:-1}
    $PY -m specblock.training chatgen --target $T --out "$OUT_ASK" --instructions "$LIST" --shard-prefix "$PFX" --shard-size 64 --batch ${BATCH:-16} \
        --max-new-tokens 256 --dtype ${FEAT_DTYPE:-float32} --threads ${THREADS:-1} ${MAX_MINUTES:+--max-minutes $MAX_MINUTES} ;;
  refs)      # 1b. reference answers (AlpacaEval responses, GSM8K solutions, stdlib functions): ~10x the
    #            tokens per CPU minute of generation, since only features are computed for them
    $PY -m specblock.training refanswers --target $T --out $REFS ;;
  features)  # 2. the feature cache: every finished chatgen shard first, then reference shards (--follow: wait for more;
    #            69 reference shards of ~70k tokens wait, ~8 min each: MAX_SHARDS=n or MAX_MINUTES=m bound a run)
    #            (reference shards only where `refs` has run; FEAT_DTYPE= / THREADS= as for data; FEAT_DTYPE=q4: the target
    #            as --dtype q4 serves it, one sequence a forward, into FEAT=$H/features/$T-q4 say: 11.8 min on the Zen 5, 2 threads)
    SRC=(--data "$DATA")
    for d in "${ASKS[@]}"; do [[ -f $d/manifest.json ]] && SRC+=(--data "$d"); done
    [[ -f $REFS/manifest.json ]] && SRC+=(--data "$REFS")
    $PY -m specblock.training featcache --target $T "${SRC[@]}" --out $FEAT --k 8 --dtype ${FEAT_DTYPE:-float32} --threads ${THREADS:-1} \
        ${FOLLOW:+--follow} ${MAX_MINUTES:+--max-minutes $MAX_MINUTES} ${MAX_SHARDS:+--max-shards $MAX_SHARDS} ;;
  specblock) # 3. SpecBlock from the cache: K = 4, M = 2, the lab recipe (2 layers: the layer-wise shift sits between
    #            layers, so one layer has none; a 1-layer run reached block-1 acceptance 0.31 / 0.045 / 0.013 / 0.008
    #            at 147 steps), an 8k-row draft vocabulary (frequencies: answers and the shared-data corpus 50/50).
    #            A step costs ~130 GFLOP per 257-token window; this CPU does ~40 GFLOP/s per core in fp32.
    train specblock "$RUN" ;;
  eagle3)    # 3b. EAGLE-3 on the same cache, vocabulary and minutes (one layer, TTT 6 depths, its public recipe)
    train eagle3 ;;
  medusa)    # 3c. Medusa-1: 4 heads on the top hidden state, same cache and vocabulary
    train medusa ;;
  parallelspec) # 3d. ParallelSpec: one layer, k = 4 tokens per forward ([MASK] queries), same cache, vocabulary, recipe
    train parallelspec ;;
  falcon)    # 3e. Falcon: one layer, blocks of 2 tokens, 3 forwards (depth 6), glancing 1.0 -> 0.25 over the run
    train falcon ;;
  sps)       # 3g. SpS: a 2-layer draft LM (hidden 256, tied vocabulary matrix started from the target's embedding in its
    #            top-256 principal directions), distilled from the cached top-8 (no target pass per step); also the
    #            assistant of hf-assisted. The full 49k vocabulary: HF's assisted generation serves it as an HF model.
    train sps ;;
  finetune)  # 3i. A trained run carried on over the cache as it stands now (chatgen shards cached since included):
    #            METHOD=specblock (or any method above) starts from runs/$T/$METHOD's weights and draft vocabulary with a
    #            fresh optimizer and schedule (lr LR=5e-4, 20 warmup steps, the rank head trained throughout), half the
    #            windows from the target's own answers (OWN_SHARE=0.5), into runs/$T/$METHOD-ft. Export it with
    #            METHOD=$METHOD-ft DEST=<dir> ... export, then compare held-out (ablation_table.py --also) before shipping.
    #            A second round: FROM=specblock-ft SUFFIX=-ft2 starts from runs/$T/specblock-ft into runs/$T/specblock-ft2.
    #            FROM=shipped starts from the drafter in git (specblock/assets/drafters/$T/$METHOD; its lineage from its training.json).
    #            FT_FLAGS= adds trainer flags after the method's own (a loss flag such as --per-k-norm; not architecture).
    #            On the Zen 5 with the cores to itself (stop 72): FT_FLAGS="--compile --skip-loops 8 --threads 2", LR=1.5e-4,
    #            SpecBlock with cross-block training ran 1,926 steps in 75 min (2.3 s a step; ~3.9 s on 1 thread on the Xeon)
    M=${METHOD:-specblock}
    SRC=${FROM:-$M}
    [[ $SRC == shipped ]] && SRC=specblock/assets/drafters/$T/$M || SRC=$H/runs/$T/$SRC
    train "$M" "$H/runs/$T/$M${SUFFIX:--ft}" --init-from "$SRC" --lr "${LR:-5e-4}" --warmup 20 --rank-freeze 0 \
        --own-share "${OWN_SHARE:-0.5}" ${FT_FLAGS:-} ;;  # FT_FLAGS: more trainer flags (e.g. --per-k-norm)
  finetune-check) # 3j. The fine-tunes against the shipped drafters they started from: each exported to $H/finetune/METHOD
    #            with the shipped serving.json (same node budget, M and widths), held-out acceptance on the same 64 windows,
    #            then a packed-fp16 bench of both side by side (FT_METHODS= picks the methods, PROMPTS= prompts per domain,
    #            CHECK_OUT= names the result files: heldout_CHECK_OUT_smollm2, bench_smollm2_CHECK_OUT; SUFFIX=-ft2 checks
    #            a second round's runs)
    FT=$H/finetune; CMP=(); SETS=(); M=ar
    for m in ${FT_METHODS:-specblock eagle3}; do
      METHOD=$m${SUFFIX:--ft} DEST=$FT/$m bash "$0" export
      cp "specblock/assets/drafters/$T/$m/serving.json" "$FT/$m/"
      CMP+=(--drafter "$m=$m:specblock/assets/drafters/$T/$m" --drafter "$m-ft=$m:$FT/$m")
      M+=",$m,$m@ft"; SETS+=(--set "$m@ft:drafter=$FT/$m")
    done
    $PY experiments/heldout_compare.py --target $T --features "$FEAT" "${CMP[@]}" --threads 2 \
        --out "experiments/results/heldout_${CHECK_OUT:-finetune}_smollm2"
    $PY -m specblock.runtime bench --target $T --methods "$M" "${SETS[@]}" --dtype packed-fp16 --prompts "${PROMPTS:-2}" \
        --runs 3 --max-new-tokens 48 --threads 2 --out "experiments/results/bench_smollm2_${CHECK_OUT:-finetune}" ;;
  vocab)     # 3f. Draft vocabulary N = 4k / 8k / 16k / full: the shipped SpecBlock and EAGLE-3 drafters (trained at 8k)
    #            re-headed (no retraining; held-out coverage and acceptance in the JSON), then benched side by side in
    #            packed-fp16 at their serving.json settings: tau, T_D%, Spd
    VS=$H/vocab_sweep
    [[ -f experiments/results/vocab_sweep_smollm2.json && -d $VS && ! ${RESWEEP:-} ]] ||  # RESWEEP=1: re-head again
      $PY experiments/vocab_sweep.py --target $T --features $FEAT --out-dir $VS --json experiments/results/vocab_sweep_smollm2.json
    M=""; SETS=()
    for m in specblock eagle3; do
      for n in 4096 8192 16384 full; do M+="$m@v$n,"; SETS+=(--set "$m@v$n:drafter=$VS/${m}_$n"); done
    done
    $PY -m specblock.runtime bench --target $T --methods "ar,${M%,}" "${SETS[@]}" --dtype packed-fp16 --prompts 1 --runs 3 \
        --max-new-tokens 48 --threads 2 --out experiments/results/bench_smollm2_vocab ;;
  vocab-heads) # 3h. The same re-heading for Medusa, ParallelSpec and Falcon, held-out figures only (no bench)
    $PY experiments/vocab_sweep.py --target $T --features $FEAT --methods medusa,parallelspec,falcon --out-dir $H/vocab_sweep \
        --windows 16 --json experiments/results/vocab_sweep_smollm2_b.json ;;
  export)    # 4. the last checkpoint as a drafter plus its model card
    METHOD=${METHOD:-specblock}  # METHOD=eagle3 / medusa / parallelspec / falcon / specblock-ft export those runs
    [[ -f $REFS/manifest.json ]] && R=(--refs "$REFS") || R=()
    for d in "${ASKS[@]}"; do [[ -f $d/manifest.json ]] && R+=(--ask "$d"); done
    $PY experiments/export_drafter.py --run-dir $H/runs/$T/$METHOD --features $FEAT --data $DATA "${R[@]}" \
        --out "${DEST:-specblock/assets/drafters/$T/${METHOD%-ft}}" ;;
  bench)     # 5. a short check against plain decoding and prompt lookup
    $PY -m specblock.runtime bench --target $T --methods ar,lookup,specblock --prompts 2 --runs 1 --max-new-tokens 64 \
        --out experiments/results/bench_smollm2_specblock_short ;;
  table)     # 6. On this AVX2 CPU bf16 has no native kernels: bf16 T(1) is 51 ms but its T(16) 6.3x T(1); fp32 T(1) is
    #            126 ms and T(16) 2.0x (calibrate). The main table runs in fp32, where trees are cheap relative to
    #            one token (also the lossless run), plus a small bf16 table. Sized for this CPU: 1 prompt per
    #            domain, 48 new tokens.
    SWEEP=""; SETS=()
    for m in specblock eagle3 medusa; do
      for b in 8 16; do SWEEP+="$m@b$b,"; SETS+=(--set "$m@b$b:budget=$b"); done
    done
    $PY -m specblock.runtime bench --target $T --methods "ar,${SWEEP%,}" "${SETS[@]}" --prompts 1 --runs 1 \
        --max-new-tokens 32 --dtype float32 --threads 2 --out experiments/results/bench_smollm2_budgets
    read -r -a BEST <<< "$($PY experiments/best_budgets.py experiments/results/bench_smollm2_budgets.json \
        --alias specblock+adapt=specblock --alias specblock@m1=specblock --write-serving specblock/assets/drafters/$T)"
    PIN=(--set specblock:M=2 --set specblock+adapt:M=2 --set specblock@m1:M=1)
    $PY -m specblock.runtime bench --target $T --methods ar,lookup,hf-lookup,medusa,eagle3,specblock,specblock@m1,specblock+adapt \
        "${BEST[@]}" "${PIN[@]}" --dtype float32 --prompts 1 --runs 3 --max-new-tokens 48 --threads 2 \
        --out experiments/results/bench_smollm2_main --trace-dir runs/traces_smollm2_main
    $PY experiments/best_method.py experiments/results/bench_smollm2_main.json --write specblock/assets/drafters/$T
    # each drafter at its serving.json budget (written above)
    $PY -m specblock.runtime bench --target $T --methods ar,lookup,medusa,eagle3,specblock \
        --dtype bfloat16 --domains code,chat --prompts 1 --runs 3 --max-new-tokens 48 --threads 2 \
        --out experiments/results/bench_smollm2_main_bf16 ;;
  packed)    # 6c. The same table in packed-fp16 (--dtype auto on an x86 CPU: fp16 weights packed for
    #            fbgemm, fp32 arithmetic): its T(n) curve is its own, so the node budgets are swept again (2/3/4/8;
    #            SpecBlock with the rank head's widths, fixed top-4, and fixed top-4 at M = 1), the winners written
    #            to serving.json, and best.json (--method auto) is chosen from the main table, where every method
    #            runs at its serving.json settings (specblock@m1: the same with M = 1). SKIP_CALIBRATE=1 keeps the
    #            latency file; SWEEP_METHODS= sweeps a subset (the others keep their serving.json), BUDGETS= other
    #            budgets, SWEEP_PROMPTS= / SWEEP_RUNS= more prompts per domain / runs (default 1 / 1); SKIP_SWEEP=1
    #            runs the main table only, SKIP_MAIN=1 the sweep only; PROMPTS= prompts per domain in the main table
    #            (default 3); MAIN_OUT= its file name.
    [[ ${SKIP_CALIBRATE:-} ]] || $PY -m specblock.runtime calibrate --target $T --dtype packed-fp16 --reps 9 \
        --out specblock/sim/data/latency_cpu_smollm2_packed_fp16.json
    SWEPT=${SWEEP_OUT:-bench_smollm2_packed_budgets}
    if [[ ! ${SKIP_SWEEP:-} ]]; then
      SWEEP=""; SETS=()
      for m in ${SWEEP_METHODS:-specblock specblock@topk4 specblock@m1 eagle3 medusa parallelspec falcon sps}; do
        for b in ${BUDGETS:-2 3 4 8}; do SWEEP+="$m@b$b,"; SETS+=(--set "$m@b$b:budget=$b"); done
      done
      for b in ${BUDGETS:-2 3 4 8}; do  # explicit widths everywhere: a serving.json written by an earlier sweep must not leak in
        [[ ,$SWEEP, == *,specblock@b$b,* ]] && SETS+=(--set "specblock@b$b:widths=2,4,10,0")
        [[ ,$SWEEP, == *,specblock@topk4@b$b,* ]] && SETS+=(--set "specblock@topk4@b$b:widths=4,4,4,4")
        [[ ,$SWEEP, == *,specblock@m1@b$b,* ]] && SETS+=(--set "specblock@m1@b$b:M=1" --set "specblock@m1@b$b:widths=4,4,4,4")
        [[ ,$SWEEP, == *,specblock@ea@b$b,* ]] && SETS+=(--set "specblock@ea@b$b:policy=specblock.policies.expected:ExpectedAcceptanceBranching")
      done
      $PY -m specblock.runtime bench --target $T --methods "ar,${SWEEP%,}" "${SETS[@]}" --prompts ${SWEEP_PROMPTS:-1} \
          --runs ${SWEEP_RUNS:-1} --max-new-tokens 32 --dtype packed-fp16 --threads 2 --out experiments/results/$SWEPT
      $PY experiments/best_budgets.py experiments/results/$SWEPT.json --write-serving specblock/assets/drafters/$T >/dev/null
    fi
    [[ ${SKIP_MAIN:-} ]] && exit 0
    # SpecBlock as shipped (serving.json: since stop 60 expected-acceptance widths at budget 4; also adapting), and
    # the paper's rank-head widths (2, 4, 10, 0) at M = 2 (specblock@rank) and M = 1 (specblock@m1), each at the rank
    # widths' best budget of the sweep $SWEPT (SWEEP_OUT=; 3 where it swept none)
    RB=$($PY experiments/best_budgets.py experiments/results/$SWEPT.json 2>/dev/null | grep -o 'specblock:budget=[0-9]*' | cut -d= -f2)
    PIN=(--set specblock@rank:M=2 --set specblock@rank:widths=2,4,10,0 --set specblock@rank:budget=${RB:-3}
         --set specblock@m1:M=1 --set specblock@m1:widths=2,4,10,0 --set specblock@m1:budget=${RB:-3})
    # eagle3+lookup and specblock+lookup: prompt lookup's branch on each drafter at its serving.json (what --method
    # METHOD --lookup-branch 3 runs; best.json may name one, and --method auto then runs it so)
    $PY -m specblock.runtime bench --target $T \
        --methods ar,hf-greedy,lookup,hf-lookup,sps,hf-assisted,medusa,parallelspec,falcon,eagle3,specblock,specblock@rank,specblock@m1,specblock+adapt,eagle3+lookup,specblock+lookup \
        "${PIN[@]}" --dtype packed-fp16 --prompts ${PROMPTS:-3} --runs 3 --max-new-tokens 48 --threads 2 \
        --out "experiments/results/${MAIN_OUT:-bench_smollm2_packed}" --trace-dir runs/traces_smollm2_packed
    $PY experiments/best_method.py "experiments/results/${MAIN_OUT:-bench_smollm2_packed}.json" --write specblock/assets/drafters/$T ;;
  compiled)  # 6e. Compiled against eager in one run (issue 16): each method twice, METHOD on the eager packed-fp16
    #            target and METHOD@c on the compiled one (the same weights, --set METHOD@c:compiled=true), interleaved,
    #            every one at its serving.json settings; Spd divides by eager plain decoding (ar), so ar@c is the
    #            compiled target's own gain. COMPILED_METHODS= picks the methods, PROMPTS= prompts per domain (default 1),
    #            DTYPE= the target's dtype (default packed-fp16; q4: the GGUF's own 4-bit weights). hf-greedy (HF's own
    #            plain generate on the same model object) and hf-greedy@bf16 (the same on the bf16 checkpoint: issue 16's
    #            stated baseline) in the same run unless HF_GREEDY=0.
    M=""; SETS=()
    [[ ${HF_GREEDY:-1} == 0 ]] || { M="hf-greedy,hf-greedy@bf16,"; SETS+=(--set "hf-greedy@bf16:dtype=bfloat16"); }
    for m in ${COMPILED_METHODS:-ar lookup medusa parallelspec falcon eagle3 specblock}; do
      M+="$m,$m@c,"; SETS+=(--set "$m@c:compiled=true")
      [[ $m == specblock ]] && SETS+=(--set "specblock:M=2" --set "specblock@c:M=2")
    done
    $PY -m specblock.runtime bench --target $T --methods "${M%,}" "${SETS[@]}" --dtype ${DTYPE:-packed-fp16} \
        --prompts ${PROMPTS:-1} --runs 3 --max-new-tokens 48 --threads 2 --out "experiments/results/${NAME:-bench_smollm2_compiled}" ;;
  compiled-budgets) # 6f. Node budgets on the compiled target (its tree cost differs from eager's: compiled_rows.md), a
    #            diagnostic, not written to serving.json: METHOD@cB at budget B for B in BUDGETS (default 2 3 5),
    #            SWEEP_METHODS (default specblock medusa parallelspec), 1 prompt per domain, 2 runs (PROMPTS= / RUNS=), DTYPE= as above.
    M="ar,ar@c"; SETS=(--set "ar@c:compiled=true"); PIN=()
    for m in ${SWEEP_METHODS:-specblock medusa parallelspec}; do
      for b in ${BUDGETS:-2 3 5}; do
        M+=",$m@c$b"; SETS+=(--set "$m@c$b:compiled=true" --set "$m@c$b:budget=$b")
        [[ $m == specblock ]] && PIN+=(--set "specblock@c$b:M=2")
      done
    done
    $PY -m specblock.runtime bench --target $T --methods "$M" "${SETS[@]}" "${PIN[@]}" --dtype ${DTYPE:-packed-fp16} --prompts ${PROMPTS:-1} \
        --runs ${RUNS:-2} --max-new-tokens 48 --threads 2 --out "experiments/results/${NAME:-bench_smollm2_compiled_budgets}" ;;
  lossless)  # 6d. Every method against plain decoding at fp32 (the lossless run: match rate and divergences, not
    #            speed), 3 prompts per domain, 48 new tokens, each at its serving.json settings. METHODS= and NAME= pick a subset and its file.
    M=${METHODS:-ar,lookup,hf-lookup,sps,hf-assisted,medusa,parallelspec,falcon,eagle3,specblock,specblock@rank,specblock@m1,specblock+adapt,eagle3+lookup,specblock+lookup}
    PIN=()  # as in the main table: specblock as shipped, the paper's rank-head widths at M = 2 and M = 1
    [[ ,$M, == *,specblock@m1,* ]] && PIN+=(--set specblock@m1:M=1 --set specblock@m1:widths=2,4,10,0)
    [[ ,$M, == *,specblock@rank,* ]] && PIN+=(--set specblock@rank:M=2 --set specblock@rank:widths=2,4,10,0)
    $PY -m specblock.runtime bench --target $T --methods "$M" "${PIN[@]}" --dtype float32 --prompts 3 --runs 1 --max-new-tokens 48 --threads ${THREADS:-2} \
        --out experiments/results/${NAME:-bench_smollm2_fp32_lossless} ;;
  widths)    # 6b. Serving-time branching (no retraining): the rank head's widths (2,4,10,0: bucket b3 ends a branch)
    #            against fixed top-k, same drafter, fp32, 1 prompt per domain, 1 run (a diagnostic, not a table)
    $PY -m specblock.runtime bench --target $T --methods ar,specblock,specblock@topk2,specblock@topk4 \
        --set specblock@topk2:widths=2,2,2,2 --set specblock@topk4:widths=4,4,4,4 --dtype float32 --prompts 1 --runs 1 \
        --max-new-tokens 48 --threads 2 --out experiments/results/bench_smollm2_widths ;;
  calibrate) # 5b. T(n) of the target on this CPU in bf16 and fp32 (the simulator's latency files; packed-fp16's is
    #            written by the packed step), then the three dtypes side by side
    $PY -m specblock.runtime calibrate --target $T --dtype float32 --reps 9 --out specblock/sim/data/latency_cpu_smollm2_fp32.json
    $PY -m specblock.runtime calibrate --target $T --dtype bfloat16 --reps 9 --out specblock/sim/data/latency_cpu_smollm2_avx2_bf16.json
    $PY experiments/target_speed.py --dtypes bfloat16,float32,packed-fp16 --attn sdpa --ctx 128 --reps 7 --threads 2 \
        --out experiments/results/target_speed_smollm2 ;;
  lookup-branch) # 6g. Prompt lookup's chain grafted onto the drafters' trees (METHOD+lookup, drafters/lookup_branch.py)
    #            beside the same drafters without it, in one run: SpecBlock at the main table's settings (M = 2 rank-head
    #            widths at budget 4, M = 1 top-4 at 3; +lookup: those budgets + 3), EAGLE-3 at its serving.json (+lookup:
    #            its budget + 3, the default). NODES="2 5" runs lookup_nodes variants instead; NAME= the file name.
    if [[ ${NODES:-} ]]; then
      M=ar; S=()
      for n in $NODES 3; do
        v=$([[ $n == 3 ]] && echo "" || echo "n$n")
        M+=",eagle3+lookup${v:+@$v},specblock+lookup@m1$v"
        S+=(--set "specblock+lookup@m1$v:M=1" --set "specblock+lookup@m1$v:widths=4,4,4,4" --set "specblock+lookup@m1$v:budget=$((3 + n))")
        [[ $n != 3 ]] && S+=(--set "eagle3+lookup@$v:lookup_nodes=$n" --set "specblock+lookup@m1$v:lookup_nodes=$n")
      done
      $PY -m specblock.runtime bench --target $T --methods "$M" "${S[@]}" --dtype packed-fp16 --prompts ${PROMPTS:-3} \
          --runs 3 --max-new-tokens 48 --threads 2 --out "experiments/results/${NAME:-bench_smollm2_lookup_nodes}"
      exit 0
    fi
    S=()
    for v in "" +lookup; do
      extra=$([[ $v ]] && echo 3 || echo 0)  # lookup's branch on top of the drafter's budget
      S+=(--set "specblock$v:M=2" --set "specblock$v:widths=2,4,10,0" --set "specblock$v:budget=$((4 + extra))"
          --set "specblock$v@m1:M=1" --set "specblock$v@m1:widths=4,4,4,4" --set "specblock$v@m1:budget=$((3 + extra))")
    done
    $PY -m specblock.runtime bench --target $T \
        --methods ar,lookup,eagle3,eagle3+lookup,specblock@m1,specblock+lookup@m1,specblock,specblock+lookup "${S[@]}" \
        --dtype packed-fp16 --prompts ${PROMPTS:-3} --runs 3 --max-new-tokens 48 --threads 2 \
        --out "experiments/results/${NAME:-bench_smollm2_lookup_branch}" ;;
  eval)      # 7. SpecBlock per domain: acceptance by in-block position, rank head, physical limit tau*T(1)/T(n)
    #            BENCH= a main table's JSON, LATENCY= a calibrate JSON of the machine it ran on
    $PY experiments/specblock_eval.py --target $T --drafter specblock/assets/drafters/$T/specblock --windows 4 \
        --dtype packed-fp16 --bench "${BENCH:-experiments/results/bench_smollm2_packed.json}" \
        --latency "${LATENCY:-specblock/sim/data/latency_cpu_smollm2_packed_fp16.json}" --out experiments/results/specblock_eval_smollm2.json ;;
  *) echo "usage: $0 data|refs|features|specblock|eagle3|medusa|parallelspec|falcon|sps|finetune|finetune-check|vocab|vocab-heads|export|bench|calibrate|table|packed|compiled|compiled-budgets|lossless|widths|lookup-branch|eval" >&2; exit 2 ;;
esac
