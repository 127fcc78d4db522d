package testenv

import "testing"

func TestNeedSkipsOutsideCI(t *testing.T) {
	t.Setenv("CI", "")
	var sub *testing.T
	t.Run("need", func(t *testing.T) {
		sub = t
		Need(t, "a tool this test pretends to lack")
		t.Error("Need returned instead of skipping")
	})
	if !sub.Skipped() {
		t.Error("Need did not skip with CI unset")
	}
	t.Setenv("CI", "true")
	if !CI() {
		t.Error("CI() is false with CI=true")
	}
}
