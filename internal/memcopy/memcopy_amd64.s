//go:build gc

#include "textflag.h"

// func copyBlocks(dst, src *byte, n uintptr)
TEXT ·copyBlocks(SB), NOSPLIT, $0-24
	MOVQ	dst+0(FP), DI
	MOVQ	src+8(FP), SI
	MOVQ	n+16(FP), BX
blocks:
	VMOVDQU	(SI), Y0
	VMOVDQU	0x20(SI), Y1
	VMOVDQU	0x40(SI), Y2
	VMOVDQU	0x60(SI), Y3
	VMOVDQU	Y0, (DI)
	VMOVDQU	Y1, 0x20(DI)
	VMOVDQU	Y2, 0x40(DI)
	VMOVDQU	Y3, 0x60(DI)
	ADDQ	$0x80, SI
	ADDQ	$0x80, DI
	SUBQ	$0x80, BX
	JNZ	blocks
	VZEROUPPER
	RET

// func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)
TEXT ·cpuid(SB), NOSPLIT, $0-24
	MOVL	eaxArg+0(FP), AX
	MOVL	ecxArg+4(FP), CX
	CPUID
	MOVL	AX, eax+8(FP)
	MOVL	BX, ebx+12(FP)
	MOVL	CX, ecx+16(FP)
	MOVL	DX, edx+20(FP)
	RET
