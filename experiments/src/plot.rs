//! Line charts as SVG (plotters), each written with the CSV of exactly the points it draws, so
//! a reader can re-plot or check any figure.

use std::fmt::Write as _;
use std::path::Path;

use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;

use crate::ExperimentError;

/// One named line.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend entry.
    pub name: String,
    /// Points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// A chart of several lines over shared axes.
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    /// Caption.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Logarithmic y axis.
    pub log_y: bool,
    /// Draw a marker at every point (few points per line).
    pub markers: bool,
    /// Markers only, no lines between them (a scatter plot).
    pub scatter: bool,
    /// The lines.
    pub series: Vec<Series>,
}

impl LineChart {
    /// Lines on linear axes with a marker at every point (few points per line).
    pub fn marked(title: String, x_label: &str, y_label: &str, series: Vec<Series>) -> Self {
        LineChart {
            title,
            x_label: x_label.into(),
            y_label: y_label.into(),
            log_y: false,
            markers: true,
            scatter: false,
            series,
        }
    }

    /// Training loss against update on a log axis, no markers.
    pub fn loss(title: String, series: Vec<Series>) -> Self {
        LineChart {
            title,
            x_label: "update".into(),
            y_label: "training loss".into(),
            log_y: true,
            markers: false,
            scatter: false,
            series,
        }
    }

    /// Writes `name.svg` and `name.csv` (columns `series,x,y`) into `dir`.
    ///
    /// # Errors
    /// An unwritable directory, or a chart with no finite point.
    pub fn write(&self, dir: &Path, name: &str) -> Result<(), ExperimentError> {
        let err = |e: String| ExperimentError::Config(format!("plot {name}: {e}"));
        std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
        let mut csv = String::from("series,x,y\n");
        for s in &self.series {
            for (x, y) in &s.points {
                let _ = writeln!(csv, "{},{x},{y}", s.name);
            }
        }
        std::fs::write(dir.join(format!("{name}.csv")), csv).map_err(|e| err(e.to_string()))?;
        let path = dir.join(format!("{name}.svg"));
        self.draw(&path).map_err(err)
    }

    /// Whether any point can be drawn: finite (and above 0 on a log axis). A chart of runs
    /// that all diverged has none.
    pub fn has_finite_point(&self) -> bool {
        self.extent().is_some()
    }

    /// The data's extent over finite points (`y > 0` on a log axis), padded.
    fn extent(&self) -> Option<((f64, f64), (f64, f64))> {
        let pts = self
            .series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!self.log_y || *y > 0.0));
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        let mut any = false;
        for &(x, y) in pts {
            any = true;
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        if !any {
            return None;
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        if self.log_y {
            (y0, y1) = (y0 / 1.1, y1 * 1.1);
        } else {
            let pad = ((y1 - y0) * 0.05).max(1e-3);
            (y0, y1) = (y0 - pad, y1 + pad);
        }
        Some(((x0, x1), (y0, y1)))
    }

    fn draw(&self, path: &Path) -> Result<(), String> {
        let ((x0, x1), (y0, y1)) = self.extent().ok_or("no finite point to draw")?;
        let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(64);
        if self.log_y {
            let mut chart = builder
                .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
                .map_err(|e| e.to_string())?;
            self.lines(&mut chart)?;
        } else {
            let mut chart = builder
                .build_cartesian_2d(x0..x1, y0..y1)
                .map_err(|e| e.to_string())?;
            self.lines(&mut chart)?;
        }
        root.present().map_err(|e| e.to_string())
    }

    /// Draws the mesh, the lines and the legend.
    fn lines<'a, X, Y>(
        &self,
        chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    ) -> Result<(), String>
    where
        X: Ranged<ValueType = f64> + ValueFormatter<f64>,
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, s) in self.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite() && (!self.log_y || *y > 0.0))
                .collect();
            let style = if self.scatter {
                color.stroke_width(0)
            } else {
                color.stroke_width(2)
            };
            let line = if self.scatter {
                Vec::new()
            } else {
                pts.clone()
            };
            chart
                .draw_series(LineSeries::new(line, style))
                .map_err(|e| e.to_string())?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
            if self.markers || self.scatter {
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| e.to_string())
    }
}

/// Whether a file in a report's `plots/` is one a chart writes ([`LineChart::write`]): an SVG or
/// the CSV beside it. `plots/` is regenerated whole, and anything else there is refused rather
/// than removed with it.
pub fn is_plot_file(name: &std::ffi::OsStr) -> bool {
    name.to_str()
        .is_some_and(|n| n.ends_with(".svg") || n.ends_with(".csv"))
}
