"""The report's sections, one file each, in the order ``oea report`` runs them.

Each is a function ``(ctx: oea.report.context.ReportContext) -> str`` (Markdown). Sections import
only ``oea.report.context`` from the report and the tools whose results they show (lazily, inside
the function), so no tool needs to import the report. To add one: write ``sections/NAME.py`` and
list it here, or call ``oea.report.context.register_section`` from anywhere.
"""

from __future__ import annotations

from oea.report.context import Section
from oea.report.sections.beyond import section_beyond
from oea.report.sections.caveats import section_caveats
from oea.report.sections.latency import section_latency, section_roofline
from oea.report.sections.overview import section_capture, section_overview
from oea.report.sections.quality import section_quality
from oea.report.sections.served import section_served
from oea.report.sections.simulation import section_simulation

DEFAULT_SECTIONS: tuple[tuple[str, Section], ...] = (
    ("overview", section_overview),
    ("capture", section_capture),
    ("simulation", section_simulation),
    ("quality", section_quality),
    ("served", section_served),
    ("latency", section_latency),
    ("roofline", section_roofline),
    ("beyond", section_beyond),
    ("caveats", section_caveats),
)

__all__ = ["DEFAULT_SECTIONS"]
