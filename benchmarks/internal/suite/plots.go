package suite

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
)

// Plots, drawn with gonum/plot: throughput against size, log-log (sizes on
// a log2 axis labelled in binary units, GB/s on a log10 one labelled in
// GB/s), one line per case, dashed for the ceilings, each written as PNG
// and SVG.

type point struct{ x, y float64 }

type series struct {
	name   string
	dashed bool
	points []point
}

type chart struct {
	title, xLabel, yLabel string
	series                []series
}

// Plot geometry: the legend sits in a column right of the axes, so that it
// never hides a line.
const (
	plotWidth   = 10 * vg.Inch
	plotHeight  = 5.6 * vg.Inch
	legendWidth = 2 * vg.Inch
	pngDPI      = 120
)

// plotFormats are the files written for every plot.
var plotFormats = []string{"png", "svg"}

// writePlots writes the report's plots into dir and returns their names.
func writePlots(dir string, r *Report) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var files []string
	save := func(base string, ch chart) error {
		if len(ch.series) == 0 {
			return nil
		}
		for _, format := range plotFormats {
			name := base + "." + format
			if err := ch.save(filepath.Join(dir, name), format); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			files = append(files, name)
		}
		return nil
	}
	primary := r.Config.Payloads[0].Name
	for _, conc := range r.Config.Concurrency {
		ch := chart{
			title:  fmt.Sprintf("Throughput against size, %d stream%s, %s", conc, plural(conc), primary),
			xLabel: "bytes per transfer", yLabel: "GB/s (1e9 bytes per second, all streams)",
		}
		for _, c := range r.Cases {
			// Calls count their bytes both ways, and rows cases have
			// one size: they have tables of their own, not a line
			// among one-way transfers.
			if c.Kind == KindCompressed || c.Call || c.Rows {
				continue
			}
			if s := r.series(c, primary, conc); len(s.points) > 0 {
				ch.series = append(ch.series, s)
			}
		}
		if err := save(fmt.Sprintf("throughput-c%d", conc), ch); err != nil {
			return nil, err
		}
	}
	conc := r.Config.Concurrency[0]
	for _, p := range r.Config.Payloads {
		ch := chart{
			title:  fmt.Sprintf("Compressed gRPC against size, %d stream%s, %s (uncompressed cases: %s)", conc, plural(conc), p.Name, primary),
			xLabel: "bytes per transfer", yLabel: "GB/s (1e9 bytes per second of uncompressed data)",
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
			ch.series = append(ch.series, s)
		}
		if !compressed {
			continue
		}
		if err := save(fmt.Sprintf("compressed-%s-c%d", p.Name, conc), ch); err != nil {
			return nil, err
		}
	}
	return files, nil
}

// series is case c's GB/s against size on payload (or, for a content-blind
// case, on whatever payload it ran) at conc streams.
func (r *Report) series(c Case, payload string, conc int) series {
	s := series{name: c.Name, dashed: c.Kind == KindCeiling}
	for _, size := range r.sizes(c.Call) {
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

var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xff, 0x7f, 0x0e, 0xff},
	{0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff}, {0x7f, 0x7f, 0x7f, 0xff},
	{0xbc, 0xbd, 0x22, 0xff}, {0x17, 0xbe, 0xcf, 0xff}, {0x39, 0x3b, 0x79, 0xff}, {0x63, 0x79, 0x39, 0xff},
}

var glyphs = []draw.GlyphDrawer{
	draw.CircleGlyph{}, draw.SquareGlyph{}, draw.TriangleGlyph{}, draw.RingGlyph{},
	draw.BoxGlyph{}, draw.PyramidGlyph{}, draw.CrossGlyph{}, draw.PlusGlyph{},
}

// plot builds the gonum plot of ch and its legend, drawn apart from it.
func (ch chart) plot() (*plot.Plot, plot.Legend, error) {
	var xs, ys []float64
	for _, s := range ch.series {
		for _, p := range s.points {
			xs = append(xs, p.x)
			ys = append(ys, p.y)
		}
	}
	p := plot.New()
	p.Title.Text = ch.title
	p.Title.TextStyle.Font.Size = vg.Points(13)
	p.X.Label.Text = ch.xLabel
	p.Y.Label.Text = ch.yLabel

	// The axes are linear in log2(size) and log10(GB/s), with ticks
	// labelled in bytes and GB/s. (gonum's LogScale would do the same, but
	// it centres the y label on the arithmetic mean of the range, which on
	// a log axis is near the top, and the plot shrinks to make room.)
	//
	// x: a labelled tick at every measured size and a minor one at the
	// powers of two between them.
	sizes := slices.Compact(slices.Sorted(slices.Values(xs)))
	p.X.Min, p.X.Max = math.Log2(sizes[0])-0.5, math.Log2(sizes[len(sizes)-1])+0.5
	p.X.Tick.Marker = sizeTicks(sizes)

	// y: from the decade below the lowest point to the one above the
	// highest.
	lo, hi := math.Floor(math.Log10(slices.Min(ys))), math.Ceil(math.Log10(slices.Max(ys)))
	if hi == lo {
		hi++
	}
	p.Y.Min, p.Y.Max = lo, hi
	p.Y.Tick.Marker = rateTicks(int(lo), int(hi))

	grid := plotter.NewGrid()
	grid.Horizontal.Color = color.Gray{0xdd}
	grid.Vertical.Color = color.Gray{0xdd}
	p.Add(grid)

	legend := plot.NewLegend()
	legend.Top, legend.Left = true, true
	legend.ThumbnailWidth = vg.Points(26)
	legend.TextStyle.Font.Size = vg.Points(10)
	for i, s := range ch.series {
		xys := make(plotter.XYs, len(s.points))
		for j, pt := range s.points {
			xys[j].X, xys[j].Y = math.Log2(pt.x), math.Log10(pt.y)
		}
		line, points, err := plotter.NewLinePoints(xys)
		if err != nil {
			return nil, legend, fmt.Errorf("%s: %w", s.name, err)
		}
		c := palette[i%len(palette)]
		line.Color = c
		line.Width = vg.Points(1.6)
		if s.dashed {
			line.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		}
		points.Color = c
		points.Shape = glyphs[i%len(glyphs)]
		points.Radius = vg.Points(2.6)
		p.Add(line, points)
		legend.Add(s.name, line, points)
	}
	return p, legend, nil
}

// save draws ch into file as format (png or svg).
func (ch chart) save(file, format string) error {
	p, legend, err := ch.plot()
	if err != nil {
		return err
	}
	var c vg.CanvasWriterTo
	switch format {
	case "png":
		c = vgimg.PngCanvas{Canvas: vgimg.NewWith(vgimg.UseWH(plotWidth, plotHeight), vgimg.UseDPI(pngDPI))}
	case "svg":
		c = vgsvg.New(plotWidth, plotHeight)
	default:
		return fmt.Errorf("unknown plot format %q", format)
	}
	dc := draw.New(c)
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	p.Draw(draw.Crop(dc, 0, -legendWidth, 0, 0))
	legend.Draw(draw.Crop(dc, plotWidth-legendWidth+vg.Points(10), 0, 0, -vg.Points(30)))

	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// sizeTicks labels every measured size in binary units and marks the
// powers of two between them; values are log2 of the size.
func sizeTicks(sizes []float64) plot.Ticker {
	return plot.TickerFunc(func(min, max float64) []plot.Tick {
		var ticks []plot.Tick
		for e := math.Ceil(min); e <= math.Floor(max); e++ {
			if !slices.Contains(sizes, math.Exp2(e)) {
				ticks = append(ticks, plot.Tick{Value: e})
			}
		}
		for _, v := range sizes {
			ticks = append(ticks, plot.Tick{Value: math.Log2(v), Label: bytesize.Format(int64(v))})
		}
		return ticks
	})
}

// rateTicks labels the decades from 10^lo to 10^hi, and 2 and 5 times them
// when there are few decades; the other multiples are minor ticks. Values
// are log10 of GB/s.
func rateTicks(lo, hi int) plot.Ticker {
	return plot.TickerFunc(func(min, max float64) []plot.Tick {
		var ticks []plot.Tick
		for d := lo; d <= hi; d++ {
			for m := 1; m < 10; m++ {
				v := float64(m) * math.Pow10(d)
				if math.Log10(v) > max+1e-9 {
					break
				}
				t := plot.Tick{Value: math.Log10(v)}
				if m == 1 || (hi-lo <= 3 && (m == 2 || m == 5)) {
					t.Label = strconv.FormatFloat(v, 'g', -1, 64)
				}
				ticks = append(ticks, t)
			}
		}
		return ticks
	})
}
