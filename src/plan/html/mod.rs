//! The plan drawn: one self-contained HTML page (no network, no external
//! scripts) for models of any size.
//!
//! - [`model`] reduces the plan to the page's data, compactly (a 93-layer
//!   model's 120,000 instructions fit in a few MB);
//! - [`layers`] finds the layers by name and folds identical ones, so the
//!   fused graph opens as a handful of boxes that expand;
//! - [`trace`] reads a measured step (Chrome trace JSON, as the runtime's
//!   profiled step writes it) and matches it to the tasks.
//!
//! The template (`templates/plan.html`) embeds the data as JSON and draws it
//! with inline JavaScript: the graph laid out in layers (longest path, then
//! ordered by the mean position of each node's predecessors) as SVG, the
//! per-SM schedule on a zoomable canvas. It decides nothing the plan did not.

pub mod layers;
pub mod model;
pub mod trace;

pub use trace::{Measured, Split, TraceError};

use super::Plan;

/// Renders the plan as one HTML page.
pub fn to_html(plan: &Plan) -> String {
    to_html_measured(plan, None)
}

/// Renders the plan as one HTML page, with a measured step overlaid.
pub fn to_html_measured(plan: &Plan, measured: Option<&Measured>) -> String {
    let page = model::page(plan, measured);
    // `</` cannot appear inside the script element.
    let json = serde_json::to_string(&page).expect("plan data serialises").replace("</", "<\\/");
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.add_template("plan.html", TEMPLATE).expect("the plan page template parses");
    env.get_template("plan.html")
        .and_then(|t| t.render(minijinja::context! { title => page.title, data => json }))
        .expect("the plan page template renders")
}

/// The page template (`templates/plan.html`): it only spells what the plan decided.
const TEMPLATE: &str = include_str!("../../../templates/plan.html");
