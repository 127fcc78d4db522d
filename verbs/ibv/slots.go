package ibv

import "github.com/tensorrpc/tensorrpc/verbs"

// This file is pure Go so that it is tested on every build.

// slot remembers one outstanding work request. Failed completions carry
// only wr_id and status, so the slot supplies the caller's ID, the opcode
// and the length; the number of free slots enforces MaxSend and MaxRecv.
type slot struct {
	id     uint64
	op     verbs.Opcode
	length int
}

// slots is a fixed table of outstanding work requests with a free list.
type slots struct {
	table []slot
	used  []bool // guards against a wr_id completing twice
	free  []uint32
}

func newSlots(n int) slots {
	s := slots{table: make([]slot, n), used: make([]bool, n), free: make([]uint32, n)}
	for i := range s.free {
		s.free[i] = uint32(n - 1 - i)
	}
	return s
}

func (s *slots) take(sl slot) (uint32, bool) {
	if len(s.free) == 0 {
		return 0, false
	}
	i := s.free[len(s.free)-1]
	s.free = s.free[:len(s.free)-1]
	s.table[i], s.used[i] = sl, true
	return i, true
}

func (s *slots) put(i uint32) (slot, bool) {
	if int(i) >= len(s.table) || !s.used[i] {
		return slot{}, false
	}
	sl := s.table[i]
	s.used[i] = false
	s.free = append(s.free, i)
	return sl, true
}

func (s *slots) outstanding() int { return len(s.table) - len(s.free) }
