//! The run's chart: KV blocks held per engine over time, and each engine's token budget.

use super::report::Report;
use crate::error::SimError;
use plotters::prelude::*;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn plot_err(e: impl std::fmt::Display) -> SimError {
    SimError::Plot(e.to_string())
}

/// Writes the chart as SVG to `path`.
pub fn write_svg(report: &Report, path: &std::path::Path) -> Result<(), SimError> {
    let root = SVGBackend::new(path, (1000, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (top, bottom) = root.split_vertically(400);
    let t_max = report.timeline.last().map_or(1.0, |p| p.t_s).max(1e-3);

    // Top: blocks held per engine, stacked.
    let mut chart = ChartBuilder::on(&top)
        .caption(
            "KV blocks held per engine (shared pool)",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..t_max, 0u32..report.pool_blocks)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("simulated seconds")
        .y_desc("blocks")
        .draw()
        .map_err(plot_err)?;
    for (e, eng) in report.engines.iter().enumerate().rev() {
        let color = COLORS[e % COLORS.len()];
        // Stacked: engine e's band sits on engines 0..e.
        let series = report.timeline.iter().map(|p| {
            let below: u32 = p.held[..=e].iter().sum();
            (p.t_s, below)
        });
        chart
            .draw_series(AreaSeries::new(series, 0, color.mix(0.6)).border_style(color))
            .map_err(plot_err)?
            .label(format!("{} (weight {})", eng.name, eng.weight))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(plot_err)?;

    // Bottom: token budget per engine per step.
    let max_budget = report
        .timeline
        .iter()
        .flat_map(|p| p.token_budget.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1);
    let mut chart = ChartBuilder::on(&bottom)
        .caption(
            "token budget per step (budget coordinator)",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..t_max, 0u32..max_budget + max_budget / 10 + 1)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("simulated seconds")
        .y_desc("tokens")
        .draw()
        .map_err(plot_err)?;
    for (e, eng) in report.engines.iter().enumerate() {
        let color = COLORS[e % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                report.timeline.iter().map(|p| (p.t_s, p.token_budget[e])),
                color.stroke_width(2),
            ))
            .map_err(plot_err)?
            .label(eng.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 12, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}
