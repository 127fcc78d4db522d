package suite

import (
	"fmt"
	"html"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
)

// Hand-written SVG plots: throughput against size, log-log, one line per
// case. No plotting dependency; the files are small and diff well.

type point struct{ x, y float64 }

type series struct {
	name   string
	dashed bool
	points []point
}

type plot struct {
	title, xLabel, yLabel string
	series                []series
}

// writePlots writes the report's plots into dir and returns their names.
func writePlots(dir string, r *Report) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var files []string
	save := func(name string, pl plot) error {
		if len(pl.series) == 0 {
			return nil
		}
		files = append(files, name)
		return os.WriteFile(filepath.Join(dir, name), []byte(pl.svg()), 0o644)
	}
	primary := r.Config.Payloads[0].Name
	for _, conc := range r.Config.Concurrency {
		pl := plot{
			title:  fmt.Sprintf("Throughput against size, %d stream%s, %s", conc, plural(conc), primary),
			xLabel: "bytes per transfer", yLabel: "GB/s",
		}
		for _, c := range r.Cases {
			if c.Kind == KindCompressed {
				continue
			}
			if s := r.series(c, primary, conc); len(s.points) > 0 {
				pl.series = append(pl.series, s)
			}
		}
		if err := save(fmt.Sprintf("throughput-c%d.svg", conc), pl); err != nil {
			return nil, err
		}
	}
	conc := r.Config.Concurrency[0]
	for _, p := range r.Config.Payloads {
		pl := plot{
			title:  fmt.Sprintf("Compressed gRPC against size, %d stream%s, %s (uncompressed cases: %s)", conc, plural(conc), p.Name, primary),
			xLabel: "bytes per transfer", yLabel: "GB/s",
		}
		compressed := false
		for _, c := range r.Cases {
			if c.Kind != KindCompressed && c.Name != "tcp-socket" && c.Name != "grpc-proto-tuned" && c.Name != "trpc-tcp" {
				continue
			}
			s := r.series(c, p.Name, conc)
			if len(s.points) == 0 {
				continue
			}
			compressed = compressed || c.Kind == KindCompressed
			pl.series = append(pl.series, s)
		}
		if !compressed {
			continue
		}
		if err := save(fmt.Sprintf("compressed-%s-c%d.svg", p.Name, conc), pl); err != nil {
			return nil, err
		}
	}
	return files, nil
}

// series is case c's GB/s against size on payload (or, for a content-blind
// case, on whatever payload it ran) at conc streams.
func (r *Report) series(c Case, payload string, conc int) series {
	s := series{name: c.Name, dashed: c.Kind == KindCeiling}
	for _, size := range r.sizes() {
		m := r.exact(c.Name, payload, size, conc)
		if m == nil && !c.Content {
			m = r.find(c.Name, payload, size, conc)
		}
		if m != nil && m.GBps > 0 {
			s.points = append(s.points, point{float64(size), m.GBps})
		}
	}
	return s
}

var palette = []string{
	"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
	"#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939",
}

const (
	plotW, plotH                       = 900, 520
	marginL, marginR, marginT, marginB = 70, 190, 40, 55
)

func (pl plot) svg() string {
	var xs, ys []float64
	for _, s := range pl.series {
		for _, p := range s.points {
			xs = append(xs, p.x)
			ys = append(ys, p.y)
		}
	}
	x0, x1 := math.Log2(slices.Min(xs)), math.Log2(slices.Max(xs))
	if x1 == x0 {
		x0, x1 = x0-1, x1+1
	}
	y0, y1 := math.Floor(math.Log10(slices.Min(ys))), math.Ceil(math.Log10(slices.Max(ys)))
	if y1 == y0 {
		y1++
	}
	iw, ih := float64(plotW-marginL-marginR), float64(plotH-marginT-marginB)
	px := func(x float64) float64 { return marginL + (math.Log2(x)-x0)/(x1-x0)*iw }
	py := func(y float64) float64 { return marginT + ih - (math.Log10(y)-y0)/(y1-y0)*ih }

	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", plotW, plotH, plotW, plotH)
	w(`<rect width="100%%" height="100%%" fill="white"/>` + "\n")
	w(`<text x="%d" y="22" font-size="15" font-weight="bold">%s</text>`+"\n", marginL, html.EscapeString(pl.title))

	// Horizontal grid at 1, 2, 5 of every decade; labels at decades.
	for d := y0; d <= y1; d++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, d)
			if math.Log10(v) > y1+1e-9 {
				break
			}
			y := py(v)
			stroke, width := "#eeeeee", 1.0
			if m == 1 {
				stroke = "#cccccc"
				w(`<text x="%d" y="%.1f" text-anchor="end" dominant-baseline="middle">%s</text>`+"\n", marginL-6, y, trimFloat(v))
			}
			w(`<line x1="%d" y1="%.1f" x2="%.0f" y2="%.1f" stroke="%s" stroke-width="%.0f"/>`+"\n", marginL, y, marginL+iw, y, stroke, width)
		}
	}
	// Vertical grid at every measured size.
	sizes := slices.Compact(slices.Sorted(slices.Values(xs)))
	for _, v := range sizes {
		x := px(v)
		w(`<line x1="%.1f" y1="%d" x2="%.1f" y2="%.0f" stroke="#cccccc"/>`+"\n", x, marginT, x, marginT+ih)
		w(`<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`+"\n", x, marginT+ih+18, bytesize.Format(int64(v)))
	}
	w(`<rect x="%d" y="%d" width="%.0f" height="%.0f" fill="none" stroke="#444444"/>`+"\n", marginL, marginT, iw, ih)
	w(`<text x="%.0f" y="%d" text-anchor="middle">%s</text>`+"\n", marginL+iw/2, plotH-12, html.EscapeString(pl.xLabel))
	w(`<text transform="translate(18 %.0f) rotate(-90)" text-anchor="middle">%s</text>`+"\n", marginT+ih/2, html.EscapeString(pl.yLabel))

	for i, s := range pl.series {
		color := palette[i%len(palette)]
		dash := ""
		if s.dashed {
			dash = ` stroke-dasharray="6 4"`
		}
		var pts []string
		for _, p := range s.points {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(p.x), py(p.y)))
		}
		w(`<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>`+"\n", color, dash, strings.Join(pts, " "))
		for _, p := range s.points {
			w(`<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"><title>%s %s: %s GB/s</title></circle>`+"\n",
				px(p.x), py(p.y), color, html.EscapeString(s.name), bytesize.Format(int64(p.x)), fmtRate(p.y))
		}
		ly := float64(marginT + 8 + 18*i)
		lx := float64(plotW - marginR + 12)
		w(`<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="%s" stroke-width="2"%s/>`+"\n", lx, ly, lx+24, ly, color, dash)
		w(`<text x="%.0f" y="%.0f" dominant-baseline="middle">%s</text>`+"\n", lx+30, ly, html.EscapeString(s.name))
	}
	w("</svg>\n")
	return b.String()
}

func trimFloat(v float64) string { return fmt.Sprintf("%g", v) }
