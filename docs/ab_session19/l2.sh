NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for shape in "128 2048" "128 4096" "128 16384" "64 4096" "256 4096" "128 2048 causal"; do
  echo "== D,S=$shape"
  timeout 90 $NCU -k regex:attention --launch-skip 3 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
     --metrics lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,lts__t_sector_hit_rate.pct \
     build/ab/sm90_ab_vwf $shape 2>&1 | grep -E "Duration|Throughput|lts__|l1tex__m|Hit Rate|Busy|Bandwidth|SM Frequency|Max Bandwidth" 
done
