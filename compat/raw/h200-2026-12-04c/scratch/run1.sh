set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 scratch/fp8_decode.py time 2>&1 | grep -v Warn | tee $OUT/time.txt
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 240 $NCU --clock-control none -k regex:"paged_decode|var_kernel" -c 8 --set full -o $OUT/dec python3 scratch/fp8_decode.py ncu > $OUT/ncu_log.txt 2>&1; echo ncu rc $?
tail -5 $OUT/ncu_log.txt
$NCU -i $OUT/dec.ncu-rep --page details > $OUT/details.txt 2>&1
$NCU -i $OUT/dec.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
grep -n "Duration\|Throughput\|Warp Cycles Per Issued\|Achieved Occupancy\|Registers Per\|Stall\|Block Limit\|Issue Slot\|Executed Ipc" $OUT/details.txt | head -150
ls -la $OUT
