# Session 33, call 2 (run with experiments/results/kernels_s33/rejected/l2_ahead_e197103.diff applied to
# e197103: the profile flag --attn-l2-ahead, the timeline configs l2a* and the tests named l2_ahead come from it).
# ncu counters of one 64K call per variant, the option's GPU tests, a timeline at 64K; writes $OUT/call2.
set -u
c=$OUT/call2; mkdir -p $c
{ git rev-parse HEAD; git status --short; } > $c/rev.txt 2>&1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" | tee -a $c/steps.txt
timeout 240 $NCU --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,lts__t_requests_srcunit_tex.sum,lts__t_sectors.sum python3 experiments/profile_kernels.py --attn-only --attn-l2-ahead=6,24 > $c/ncu.log 2>&1
echo "ncu exit $?" | tee -a $c/steps.txt
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_attention.py -k l2_ahead > $c/gtest.log 2>&1
echo "gtest exit $?" | tee -a $c/steps.txt
OUT=$c/tl timeout 200 python3 experiments/timeline_attention.py --contexts 65536 --configs default,l2a8,split_empty_merge,l2a8_empty_merge > $c/tl.log 2>&1
echo "tl exit $?" | tee -a $c/steps.txt
tar czf $c/tl.tgz -C $c tl && rm -rf $c/tl
