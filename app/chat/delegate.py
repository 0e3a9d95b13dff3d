"""Paints one message row: role line, rich-text body (cached QTextDocument), actions row.

Geometry is computed in one place (`MessageDelegate.geometry`) and used both for painting and
for the view's hit-testing, so what is drawn is what is clicked. User messages are right-hand
bubbles, assistant messages are full-width text with a role line (ChatGPT / LM Studio style).
The actions row (‹ 1/3 › switcher, copy, edit or regenerate, branch) is reserved on every row
so hovering never changes the layout; buttons are drawn on the hovered, current or last row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QPoint, QRect, QSize, Qt
from PySide6.QtGui import (
    QAbstractTextDocumentLayout,
    QColor,
    QFont,
    QFontMetrics,
    QPainter,
    QPalette,
)
from PySide6.QtWidgets import QListView, QStyle, QStyledItemDelegate, QStyleOptionViewItem

from app.chat.message_model import ChatMessageModel, RenderEntry, status_text
from app.core.records import Message, Status
from app.ui import colors, icons
from app.ui.theme import theme_manager

H_PAD = 18
TOP_PAD = 10
BOTTOM_PAD = 4
BUBBLE_PAD_X = 12
BUBBLE_PAD_Y = 8
LINE_GAP = 4
ACTION_SIZE = 24
ICON = 15
USER_MAX_FRACTION = 0.82

ACTION_TIPS = {
    "copy": "Copy message",
    "edit": "Edit and resend",
    "regenerate": "Regenerate reply",
    "branch": "Branch a new chat from here",
    "prev": "Previous alternative",
    "next": "Next alternative",
}


@dataclass
class RowGeometry:
    header: QRect  # role line (assistant only; empty for user)
    bubble: QRect  # user bubble (empty for assistant)
    body: QRect  # where the document is drawn
    actions: dict[str, QRect] = field(default_factory=dict)
    counter: QRect = field(default_factory=QRect)  # "2/3" between ‹ and ›

    def hit(self, pos: QPoint) -> str | None:
        for name, rect in self.actions.items():
            if rect.contains(pos):
                return name
        return None


class MessageDelegate(QStyledItemDelegate):
    def __init__(self, view: QListView) -> None:
        super().__init__(view)
        self.view = view

    # ---- geometry ------------------------------------------------------------------------

    def _model(self) -> ChatMessageModel:
        return self.view.model()  # type: ignore[return-value]

    def _small_font(self) -> QFont:
        f = QFont(self.view.font())
        f.setPointSizeF(max(7.0, f.pointSizeF() * 0.86))
        return f

    def geometry(self, rect: QRect, row: int) -> RowGeometry:
        model = self._model()
        msg = model.message(row)
        entry = model.entry(row)
        width = rect.width()
        small = QFontMetrics(self._small_font())
        y = rect.top() + TOP_PAD
        if msg.role == "user":
            max_w = max(80, int((width - 2 * H_PAD) * USER_MAX_FRACTION) - 2 * BUBBLE_PAD_X)
            h = entry.layout(max_w)
            text_w = max(int(entry.ideal_width), 16)
            bubble = QRect(
                rect.right() - H_PAD - text_w - 2 * BUBBLE_PAD_X + 1,
                y,
                text_w + 2 * BUBBLE_PAD_X,
                h + 2 * BUBBLE_PAD_Y,
            )
            body = QRect(bubble.left() + BUBBLE_PAD_X, y + BUBBLE_PAD_Y, max_w, h)
            header = QRect()
            y = bubble.bottom() + 1 + LINE_GAP
        else:
            header = QRect(rect.left() + H_PAD, y, width - 2 * H_PAD, small.height())
            y = header.bottom() + 1 + LINE_GAP
            text_w = max(40, width - 2 * H_PAD)
            h = entry.layout(text_w)
            if msg.status in Status.LIVE and not msg.content:
                h = max(h, small.height())
            body = QRect(rect.left() + H_PAD, y, text_w, h)
            bubble = QRect()
            y = body.bottom() + 1 + LINE_GAP
        geo = RowGeometry(header=header, bubble=bubble, body=body)
        self._place_actions(geo, msg, rect, y, small)
        return geo

    def _place_actions(
        self, geo: RowGeometry, msg: Message, rect: QRect, y: int, small: QFontMetrics
    ) -> None:
        tree = self._model().session.tree
        _pos, count = tree.sibling_position(msg.id)
        names = ["copy", "edit" if msg.role == "user" else "regenerate", "branch"]
        items: list[tuple[str, int]] = []
        if count > 1:
            counter_w = small.horizontalAdvance(f"{count}/{count}") + 6
            items += [("prev", ACTION_SIZE), ("counter", counter_w), ("next", ACTION_SIZE)]
        items += [(n, ACTION_SIZE) for n in names]
        total = sum(w for _, w in items)
        x = rect.right() - H_PAD - total + 1 if msg.role == "user" else rect.left() + H_PAD - 4
        for name, w in items:
            r = QRect(x, y, w, ACTION_SIZE)
            if name == "counter":
                geo.counter = r
            else:
                geo.actions[name] = r
            x += w

    def sizeHint(
        self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex
    ) -> QSize:
        width = max(200, self.view.viewport().width())
        geo = self.geometry(QRect(0, 0, width, 10), index.row())
        bottom = max(r.bottom() for r in geo.actions.values()) if geo.actions else geo.body.bottom()
        return QSize(width, bottom + 1 + BOTTOM_PAD)

    # ---- painting ------------------------------------------------------------------------

    def paint(
        self,
        painter: QPainter,
        option: QStyleOptionViewItem,
        index: QModelIndex | QPersistentModelIndex,
    ) -> None:
        model = self._model()
        row = index.row()
        msg = model.message(row)
        entry = model.entry(row)
        geo = self.geometry(option.rect, row)
        pal: QPalette = option.palette
        text = pal.color(QPalette.ColorRole.Text)
        muted = pal.color(QPalette.ColorRole.PlaceholderText)
        accent = colors.accent_color(model.session.id)
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        if option.state & QStyle.StateFlag.State_HasFocus and self.view.hasFocus():
            focus = QColor(accent)
            focus.setAlphaF(0.55)
            painter.setPen(focus)
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawRoundedRect(option.rect.adjusted(6, 3, -6, -2), 8, 8)
        if msg.role == "user":
            bg = QColor(accent)
            bg.setAlphaF(0.16 if model_dark() else 0.11)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(bg)
            painter.drawRoundedRect(geo.bubble, 14, 14)
        else:
            self._paint_header(painter, geo, msg, accent, muted)
        self._paint_body(painter, geo, msg, entry, text, muted)
        self._paint_actions(painter, geo, msg, row, muted, text)
        painter.restore()

    def _paint_header(
        self, painter: QPainter, geo: RowGeometry, msg: Message, accent: QColor, muted: QColor
    ) -> None:
        small = self._small_font()
        fm = QFontMetrics(small)
        d = 8
        cy = geo.header.center().y()
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(accent)
        painter.drawEllipse(QRect(geo.header.left(), cy - d // 2 + 1, d, d))
        bold = QFont(small)
        bold.setWeight(QFont.Weight.DemiBold)
        painter.setFont(bold)
        painter.setPen(muted)
        x = geo.header.left() + d + 6
        label = "Tool" if msg.role == "tool" else "Assistant"
        painter.drawText(
            QRect(x, geo.header.top(), geo.header.width(), geo.header.height()),
            Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft,
            label,
        )
        x += QFontMetrics(bold).horizontalAdvance(label) + 8
        badge = status_text(msg) if msg.status not in Status.LIVE else ""
        usage = msg.meta.get("usage") or {}
        detail = ""
        if msg.status in (Status.COMPLETE, Status.LENGTH) and usage.get("generated_tokens"):
            tps = usage.get("decode_tokens_per_s") or 0
            detail = f"{usage['generated_tokens']} tokens"
            if tps:
                detail += f" · {tps:.1f} tok/s"
        if badge:
            color = QColor("#d64545") if msg.status == Status.ERROR else QColor("#c27c0e")
            if msg.status == Status.LENGTH:
                color = muted
            w = fm.horizontalAdvance(badge) + 12
            r = QRect(x, geo.header.top(), w, geo.header.height())
            fill = QColor(color)
            fill.setAlphaF(0.14)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(fill)
            painter.drawRoundedRect(r, r.height() / 2, r.height() / 2)
            painter.setPen(color)
            painter.setFont(small)
            painter.drawText(r, Qt.AlignmentFlag.AlignCenter, badge)
            x += w + 8
        if detail and geo.header.right() - x > 20:
            painter.setFont(small)
            painter.setPen(muted)
            room = geo.header.right() - x
            if fm.horizontalAdvance(detail) > room:
                detail = detail.split(" · ")[0]  # drop the speed before eliding the count
            painter.drawText(
                QRect(x, geo.header.top(), room, geo.header.height()),
                Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft,
                fm.elidedText(detail, Qt.TextElideMode.ElideRight, room),
            )

    def _paint_body(
        self,
        painter: QPainter,
        geo: RowGeometry,
        msg: Message,
        entry: RenderEntry,
        text: QColor,
        muted: QColor,
    ) -> None:
        if msg.status in Status.LIVE and not msg.content:
            painter.setFont(self._small_font())
            painter.setPen(muted)
            text_now = self._model().waiting_text(msg)
            painter.drawText(
                geo.body,
                Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop,
                QFontMetrics(self._small_font()).elidedText(
                    text_now, Qt.TextElideMode.ElideRight, geo.body.width()
                ),
            )
            return
        painter.save()
        painter.translate(geo.body.topLeft())
        ctx = QAbstractTextDocumentLayout.PaintContext()
        ctx.palette.setColor(QPalette.ColorRole.Text, text)
        entry.doc.documentLayout().draw(painter, ctx)
        painter.restore()
        if msg.status == Status.STREAMING:
            # a caret at the end of the streaming text
            painter.setPen(Qt.PenStyle.NoPen)
            c = QColor(text)
            c.setAlphaF(0.5)
            painter.setBrush(c)
            painter.drawRoundedRect(QRect(geo.body.left(), geo.body.bottom() + 3, 8, 3), 1, 1)

    def _paint_actions(
        self,
        painter: QPainter,
        geo: RowGeometry,
        msg: Message,
        row: int,
        muted: QColor,
        text: QColor,
    ) -> None:
        model = self._model()
        shown = (
            row == getattr(self.view, "hover_row", -1)
            or row == self.view.currentIndex().row()
            or row == model.rowCount() - 1
        )
        pos, count = model.session.tree.sibling_position(msg.id)
        busy = model.session.busy
        hovered = getattr(self.view, "hover_action", None)
        for name, rect in geo.actions.items():
            is_switch = name in ("prev", "next")
            if not is_switch and not shown:
                continue
            enabled = True
            if name == "prev":
                enabled = pos > 0
            elif name == "next":
                enabled = pos < count - 1
            elif name in ("regenerate", "edit"):
                enabled = not busy
            if row == getattr(self.view, "hover_row", -1) and hovered == name and enabled:
                bg = QColor(text)
                bg.setAlphaF(0.08)
                painter.setPen(Qt.PenStyle.NoPen)
                painter.setBrush(bg)
                painter.drawRoundedRect(rect.adjusted(1, 1, -1, -1), 6, 6)
            c = QColor(muted)
            if not enabled:
                c.setAlphaF(0.3)
            pm = icons.pixmap(
                name,
                c.name(QColor.NameFormat.HexRgb),
                ICON,
                painter.device().devicePixelRatioF(),
                c.alphaF(),
            )
            painter.drawPixmap(
                rect.center().x() - ICON // 2 + 1, rect.center().y() - ICON // 2 + 1, pm
            )
        if count > 1 and not geo.counter.isNull():
            painter.setFont(self._small_font())
            painter.setPen(muted)
            painter.drawText(geo.counter, Qt.AlignmentFlag.AlignCenter, f"{pos + 1}/{count}")


def model_dark() -> bool:
    return theme_manager().dark
