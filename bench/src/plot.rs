//! `tandem-bench plot RESULTS.json...`: PNG and SVG pictures of `bench serve` and `bench
//! multiturn` results, one line per system (each file's `label`):
//!
//! - `ttft_cdf`, `itl_cdf`: the distribution of TTFT and of inter-token latency at every load
//!   level (log-scaled time axis);
//! - `frontier`: TTFT p50 and TPOT p50 against output tokens/s across the levels, the
//!   latency-throughput frontier;
//! - `multiturn_ttft`: median TTFT per turn of multi-turn runs.
//!
//! Text needs a TrueType font (`--font`, else DejaVu Sans or Liberation Sans where the system
//! keeps them); plotters draws it with `ab_glyph`, so nothing links fontconfig or freetype.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::multiturn;
use crate::serve;
use crate::stats::median;

#[derive(Args, Debug)]
pub(crate) struct PlotArgs {
    /// Results of `bench serve --json`/`--out` or `bench multiturn --json`, one system each.
    #[arg(required = true)]
    results: Vec<PathBuf>,
    /// Where the pictures go (created if missing).
    #[arg(long, default_value = "target/bench-plots")]
    out: PathBuf,
    /// A TrueType font for the text.
    #[arg(long)]
    font: Option<PathBuf>,
}

const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

const SIZE: (u32, u32) = (1000, 620);

/// One color per system, dark enough to read on white.
const COLORS: [RGBColor; 6] = [
    RGBColor(213, 94, 0),
    RGBColor(0, 114, 178),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 86, 86),
    RGBColor(230, 159, 0),
];

/// One line of a chart.
#[derive(Debug)]
struct Line {
    name: String,
    points: Vec<(f64, f64)>,
    /// Text beside each point (the load level of a frontier point); empty for none.
    point_labels: Vec<String>,
    /// Which system it belongs to (its color).
    system: usize,
}

/// One chart.
#[derive(Debug)]
struct Chart {
    title: String,
    x: String,
    y: String,
    log_x: bool,
    legend: SeriesLabelPosition,
    lines: Vec<Line>,
}

/// The empirical CDF of `v`.
fn cdf(v: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

fn load_label(l: &serve::Level) -> String {
    match l.mode.as_str() {
        "rate" => format!("{} req/s", l.value),
        _ => format!("c={}", l.value),
    }
}

/// Registers the TrueType font `font` (else the first of [`FONTS`] found) as plotters'
/// sans-serif.
fn register_font(font: Option<&PathBuf>) -> anyhow::Result<()> {
    let font = match font {
        Some(f) => f.clone(),
        None => FONTS
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .context("no TrueType font found; pass --font PATH.ttf")?,
    };
    let bytes = std::fs::read(&font).with_context(|| format!("cannot read {}", font.display()))?;
    // plotters keeps registered fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{} is not a usable TrueType font", font.display()))
}

pub(crate) fn plot(args: &PlotArgs) -> anyhow::Result<()> {
    register_font(args.font.as_ref())?;

    let mut serves = Vec::new();
    let mut multiturns = Vec::new();
    for path in &args.results {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        if v.get("levels").is_some() {
            serves.push(
                serde_json::from_value::<serve::Results>(v)
                    .with_context(|| format!("{} is not a bench serve result", path.display()))?,
            );
        } else if v.get("turns").is_some() {
            multiturns.push(
                serde_json::from_value::<multiturn::Results>(v).with_context(|| {
                    format!("{} is not a bench multiturn result", path.display())
                })?,
            );
        } else {
            bail!(
                "{}: neither a bench serve nor a bench multiturn result",
                path.display()
            );
        }
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let mut charts: Vec<(&str, Vec<Chart>)> = Vec::new();
    if !serves.is_empty() {
        let cdf_chart =
            |title: &str, x: &str, y: &str, pick: fn(&serve::Samples) -> &Vec<f64>| Chart {
                title: title.into(),
                x: x.into(),
                y: y.into(),
                log_x: true,
                legend: SeriesLabelPosition::LowerRight,
                lines: serves
                    .iter()
                    .enumerate()
                    .flat_map(|(s, r)| {
                        r.levels.iter().map(move |l| Line {
                            name: format!("{} {}", r.label, load_label(l)),
                            points: cdf(pick(&l.samples)),
                            point_labels: Vec::new(),
                            system: s,
                        })
                    })
                    .collect(),
            };
        charts.push((
            "ttft_cdf",
            vec![cdf_chart(
                "Time to first token",
                "TTFT (ms, log scale)",
                "fraction of requests",
                |s| &s.ttft_ms,
            )],
        ));
        charts.push((
            "itl_cdf",
            vec![cdf_chart(
                "Inter-token latency",
                "ITL (ms, log scale)",
                "fraction of gaps between tokens",
                |s| &s.itl_ms,
            )],
        ));
        let frontier = |title: &str, y: &str, pick: fn(&serve::Level) -> f64| Chart {
            title: title.into(),
            x: "output tokens/s".into(),
            y: y.into(),
            log_x: false,
            legend: SeriesLabelPosition::UpperLeft,
            lines: serves
                .iter()
                .enumerate()
                .map(|(s, r)| Line {
                    name: r.label.clone(),
                    points: r.levels.iter().map(|l| (l.output_tok_s, pick(l))).collect(),
                    point_labels: r.levels.iter().map(load_label).collect(),
                    system: s,
                })
                .collect(),
        };
        charts.push((
            "frontier",
            vec![
                frontier("TTFT p50 against throughput", "TTFT p50 (ms)", |l| {
                    l.ttft_ms.p50
                }),
                frontier("TPOT p50 against throughput", "TPOT p50 (ms)", |l| {
                    l.tpot_ms.p50
                }),
            ],
        ));
    }
    if !multiturns.is_empty() {
        let lines = multiturns
            .iter()
            .enumerate()
            .map(|(s, r)| {
                let mut by_turn: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
                for t in &r.turns {
                    by_turn.entry(t.turn).or_default().push(t.ttft_ms);
                }
                Line {
                    name: r.label.clone(),
                    points: by_turn
                        .into_iter()
                        .map(|(turn, v)| ((turn + 1) as f64, median(v)))
                        .collect(),
                    point_labels: Vec::new(),
                    system: s,
                }
            })
            .collect();
        charts.push((
            "multiturn_ttft",
            vec![Chart {
                title: "Multi-turn chat: TTFT by turn (median over sessions)".into(),
                x: "turn".into(),
                y: "TTFT (ms)".into(),
                log_x: false,
                legend: SeriesLabelPosition::UpperLeft,
                lines,
            }],
        ));
    }
    for (name, panels) in &charts {
        let svg = args.out.join(format!("{name}.svg"));
        let png = args.out.join(format!("{name}.png"));
        let size = (SIZE.0 * panels.len() as u32, SIZE.1);
        draw(SVGBackend::new(&svg, size).into_drawing_area(), panels)
            .map_err(|e| anyhow::anyhow!("drawing {}: {e}", svg.display()))?;
        draw(BitMapBackend::new(&png, size).into_drawing_area(), panels)
            .map_err(|e| anyhow::anyhow!("drawing {}: {e}", png.display()))?;
        println!("{}", png.display());
        println!("{}", svg.display());
    }
    Ok(())
}

/// Draws `panels` side by side on `root`.
fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    panels: &[Chart],
) -> Result<(), Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let areas = root.split_evenly((1, panels.len()));
    for (area, chart) in areas.iter().zip(panels) {
        panel(area, chart)?;
    }
    root.present()?;
    Ok(())
}

fn bounds(lines: &[Line], axis: fn(&(f64, f64)) -> f64) -> (f64, f64) {
    let v = lines.iter().flat_map(|l| l.points.iter().map(axis));
    let (lo, hi) = v.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    if lo.is_finite() && hi.is_finite() {
        (lo, hi)
    } else {
        (0.0, 1.0)
    }
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    chart: &Chart,
) -> Result<(), Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    let (x_lo, x_hi) = bounds(&chart.lines, |p| p.0);
    let (_, y_hi) = bounds(&chart.lines, |p| p.1);
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(&chart.title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72);
    let y_range = 0.0..(y_hi * 1.08).max(1e-9);
    // A log axis is drawn as log10 on a linear one, labelled with the values to two significant
    // digits: plotters' own log scale labels only the powers of ten.
    let fx = |x: f64| if chart.log_x { x.max(1e-3).log10() } else { x };
    let at = |(x, y): (f64, f64)| (fx(x), y);
    let x_label = |x: &f64| {
        if chart.log_x {
            let v = 10f64.powf(*x);
            let unit = 10f64.powi(v.log10().floor() as i32 - 1);
            number((v / unit).round() * unit)
        } else {
            number(*x)
        }
    };
    let style = |i: usize| COLORS[i % COLORS.len()].stroke_width(2);
    // Lines of one system share its color; its levels differ by marker size.
    macro_rules! series {
        ($c:expr) => {{
            let mut c = $c;
            c.configure_mesh()
                .x_labels(8)
                .x_label_formatter(&x_label)
                .y_label_formatter(&|y| number(*y))
                .x_desc(chart.x.as_str())
                .y_desc(chart.y.as_str())
                .label_style(("sans-serif", 15))
                .axis_desc_style(("sans-serif", 17))
                .draw()?;
            let mut seen_in_system: BTreeMap<usize, usize> = BTreeMap::new();
            for line in &chart.lines {
                let k = seen_in_system.entry(line.system).or_insert(0);
                let (color, level) = (style(line.system), *k);
                *k += 1;
                c.draw_series(LineSeries::new(line.points.iter().map(|&p| at(p)), color))?
                    .label(line.name.as_str())
                    .legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (24, 0)], color)
                            + marker((12, 0), level, color)
                    });
                // Every point of a short line; about ten along a long one (a CDF).
                let step = (line.points.len() / 10).max(1);
                c.draw_series(
                    line.points
                        .iter()
                        .step_by(step)
                        .map(|&p| EmptyElement::at(at(p)) + marker((0, 0), level, color)),
                )?;
                c.draw_series(line.points.iter().zip(&line.point_labels).map(|(&p, t)| {
                    Text::new(t.clone(), at(p), ("sans-serif", 14).into_font()).into_dyn()
                }))?;
            }
            c.configure_series_labels()
                .position(chart.legend.clone())
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 15))
                .draw()?;
        }};
    }
    if chart.log_x {
        series!(builder.build_cartesian_2d(fx(x_lo * 0.8)..fx(x_hi * 1.25), y_range)?);
    } else {
        let pad = (x_hi - x_lo).max(1.0) * 0.06;
        series!(builder.build_cartesian_2d((x_lo - pad).max(0.0)..x_hi + pad, y_range)?);
    }
    Ok(())
}

/// An axis label: whole numbers without decimals.
fn number(x: f64) -> String {
    if x.abs() >= 10.0 || x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// The marker of a system's `level`-th line: circles that grow with the level, filled and
/// hollow in turn, so the levels of one system (one color) stay apart.
fn marker<DB: DrawingBackend>(
    p: (i32, i32),
    level: usize,
    color: ShapeStyle,
) -> DynElement<'static, DB, (i32, i32)> {
    let style = if level.is_multiple_of(2) {
        color.filled()
    } else {
        color.stroke_width(2)
    };
    Circle::new(p, 3 + 2 * level as i32, style).into_dyn()
}
