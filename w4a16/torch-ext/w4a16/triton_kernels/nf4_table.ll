; The NF4 pair table of the packed-fp16 GEMV (`nf4.NF4_PAIR_TABLE`): a static shared-memory array, which Triton's
; language cannot declare, linked into the kernels that call `nf4_pair_table_base` (Triton's extern_libs).
@nf4_pair_table = internal addrspace(3) global [8192 x i32] undef, align 16

define i32 @nf4_pair_table_base(i32 %unused) #0 {
  %base = ptrtoint ptr addrspace(3) @nf4_pair_table to i32
  ret i32 %base
}

; Half of it (16 copies of each entry, E75): two lanes share each copy, for the kernels whose occupancy 32 KB cuts.
@nf4_pair_table_16 = internal addrspace(3) global [4096 x i32] undef, align 16

define i32 @nf4_pair_table_16_base(i32 %unused) #0 {
  %base = ptrtoint ptr addrspace(3) @nf4_pair_table_16 to i32
  ret i32 %base
}

attributes #0 = { alwaysinline nounwind readnone }
